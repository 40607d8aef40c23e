"""The `mist-ds` command."""
