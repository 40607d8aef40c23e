"""The benchmarks, a package so that each script runs as `python -m benchmarks.<name>` from the repository root
and imports the others as `benchmarks.<name>`. Not shipped: pyproject's package discovery includes mist_ds only."""
