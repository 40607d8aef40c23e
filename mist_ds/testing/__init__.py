"""Verification tools shipped with mist_ds (as numpy.testing is with numpy) that compare engines with the
cost model: the model-state cases against cost/memory.py (`model_states`) and one step's census against
cost/accounting.py (`step_census`). The tests and the benchmarks use them; nothing in the planner or the
runtime imports them. Running engines and observing them is mist_ds/observe."""
