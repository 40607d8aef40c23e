"""Cost model: time and memory of strategies on the executor that executes them (vectorized)."""
