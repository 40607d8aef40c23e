"""Human and JSON reports of what the planner knows and decides."""
