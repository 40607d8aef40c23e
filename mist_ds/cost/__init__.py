"""Cost model: time and memory of strategies on the runtime that executes them (vectorized)."""
