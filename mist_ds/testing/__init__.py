"""Verification tools shipped with mist_ds (as numpy.testing is with numpy): run real DeepSpeed on CPU
ranks with a hard timeout (`ranks`), count what a live engine holds (`census`), and the model-state
cases that compare engines with cost/memory.py (`model_states`). The tests and the benchmarks both
use them; nothing in the planner imports them."""
