"""Soak: every runtime-`mist` case of the tests, launched again and again on CPU ranks as `mist-ds measure` runs
it; crashes, hangs and census mismatches counted (issue 25).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak > benchmarks/results/soak.md
    # some cases, for development:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak 6 pp2-dp2-bf16-all

The first argument is the number of launches in all (default 50), spread round-robin over the cases (the
rest: names of cases to run). Each launch is one real DeepSpeed job on local gloo ranks through
mist_ds.observe.measure's worker, the path every `mist-ds measure` takes and the one that crashed: warm-up,
timed steps, the peak-memory step under torch's profiler, the step census (FLOPs and collective bytes, counted
at the dispatcher), a step with the model-state census, what ran, and the teardown (`PlannedEngine.close`,
then the process group).

Counted per launch:
- crash: the job exited non-zero (a signal such as SIGSEGV, or an exception), with the first line that names it;
- hang: the job ran past LAUNCH_TIMEOUT_S (its whole process group is killed);
- census mismatch: any rank whose FLOPs differ from the prediction's, whose bytes of a collective kind and
  group differ from the prediction's by more than the scalar control messages (CONTROL_BYTES), or whose
  model-state bytes of a field differ from the prediction's beyond the residual formulas the project states
  (mist_ds/testing/model_states.py assert_model_states_are_predicted: also every storage classified, weights
  never 0 B).
The plan's overlap features as the engine ran them (from what ran, not the plan: the gather's chunks, the
reduction's buckets in the last backward) are reported per case.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from benchmarks.common import results_header, run_start, SoakTally, soak_footer, table_text
from benchmarks.cpu_constants import machine_text

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.observe.measure import MEASURE_WORKER, measure_payload
from mist_ds.observe.ranks import CPU_ENV, LaunchTimeout, launch
from mist_ds.specs.groups import stage_of
from mist_ds.testing.model_states import assert_model_states_are_predicted
from mist_ds.testing.step_census import step_census_mismatches

COMMAND = "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak > benchmarks/results/soak.md"
LAUNCHES = 50
WARMUP_STEPS = 1
TIMED_STEPS = 2
LAUNCH_TIMEOUT_S = 300.0
"""A launch takes 15-40 s on the loaded 2-core VM; past this it is a hang."""
TINY = ("model=tiny", "cluster=cpu", "strategy.runtime=mist", "strategy.micro_batch_size=1")

# name -> (ranks, overrides): the runtime-`mist` cases of tests/test_mist_runtime.py and tests/test_runtime.py,
# and the layout that crashed (pp 2 dp 2, [5, 3] blocks, every feature on)
CASES = {
    "pp2-dp2-bf16-all": (4, ("model.num_layers=8", "strategy.pp=2", "strategy.layers_per_stage=[5,3]",
                             "strategy.zero_stage=0", "train.precision=bf16", "train.global_batch_size=8",
                             "strategy.offload.activations=0.5")),
    "pp2-dp2-bf16": (4, ("model.num_layers=4", "strategy.pp=2", "strategy.zero_stage=0", "train.precision=bf16",
                         "train.global_batch_size=4")),
    "pp2-dp2-fp32-ao": (4, ("model.num_layers=4", "strategy.pp=2", "strategy.zero_stage=0", "train.precision=fp32",
                            "train.global_batch_size=4", "strategy.offload.activations=0.5")),
    "pp1-tp2-dp2-zero0-bf16": (4, ("model.num_layers=4", "strategy.pp=1", "strategy.tp=2", "strategy.zero_stage=0",
                                   "train.precision=bf16", "train.global_batch_size=4")),
    "pp1-tp2-dp2-zero1-bf16": (4, ("model.num_layers=4", "strategy.pp=1", "strategy.tp=2", "strategy.zero_stage=1",
                                   "train.precision=bf16", "train.global_batch_size=4")),
    "pp1-dp2-zero1-offload": (2, ("strategy.pp=1", "strategy.zero_stage=1", "train.precision=bf16",
                                  "train.global_batch_size=8", "strategy.offload.grads=1",
                                  "strategy.offload.optimizer=1", "strategy.offload.activations=1")),
}


def case_specs(name: str):
    ranks, overrides = CASES[name]
    return compose([*TINY, f"cluster.gpus_per_node={ranks}", *overrides])


def census_mismatches(specs, config: dict, prediction, results: list[dict]) -> list[str]:
    """What the engines counted against what the cost model prices, per rank (module docstring)."""
    par = specs.strategy.parallelism
    found = []
    for rank, result in enumerate(results):
        stage = stage_of(par, rank)
        zero3 = specs.strategy.stages[stage].zero_stage == 3
        found += [f"rank {rank} {mismatch}" for mismatch in step_census_mismatches(
            result["flops"], result["comm_bytes"], prediction.flops_per_rank[stage],
            prediction.comm_bytes_per_rank[stage], zero3)]
    try:  # model states field by field, up to the residual formulas the project states (testing/model_states.py)
        assert_model_states_are_predicted(specs, config, prediction.to_dict(), results, "soak")
    except AssertionError as error:
        found.append(str(error).splitlines()[0][:300])
    return found


def features_ran(results: list[dict]) -> str:
    """The overlap features as the engines report them (what ran)."""
    overlaps = [r["what_ran"]["overlap"] for r in results]
    chunks = sorted({o["gather_chunks"] for o in overlaps if o["gather_weights_in_first_forward"]})
    reduced = sorted({o["reduced_in_backward"] for o in overlaps if o["overlap_grad_reduce"]})
    parts = [f"gather chunks {chunks}" if chunks else "no gather",
             f"reduced in backward {reduced}" if reduced else "no reduction in backward"]
    return "; ".join(parts)


@dataclasses.dataclass
class Tally(SoakTally):
    ran: str = ""


def first_failure_line(log: str) -> str:
    for needle in ("SIGSEGV", "SIGABRT", "signal", "Fatal Python error", "Error", "error"):
        for line in log.splitlines():
            if needle in line:
                return line.strip()[:160]
    return log.strip().splitlines()[-1][:160] if log.strip() else "no output"


def soak(names: list[str], launches: int) -> dict[str, Tally]:
    tallies = {name: Tally() for name in names}
    specs = {name: case_specs(name) for name in names}
    predictions = {name: predict(specs[name]) for name in names}
    payloads = {name: measure_payload(specs[name], WARMUP_STEPS, TIMED_STEPS) for name in names}
    for index in range(launches):
        name = names[index % len(names)]
        tally, ranks = tallies[name], CASES[name][0]
        tally.launches += 1
        start = time.perf_counter()
        try:
            results = launch(MEASURE_WORKER, ranks, payloads[name],
                             timeout_s=LAUNCH_TIMEOUT_S, env=CPU_ENV)
        except LaunchTimeout:
            tally.hangs += 1
            continue
        except RuntimeError as error:
            tally.crashes.append(first_failure_line(str(error)))
            continue
        finally:
            tally.seconds.append(time.perf_counter() - start)
            print(f"launch {index + 1}/{launches} {name}: {tally.seconds[-1]:.0f} s", file=sys.stderr, flush=True)
        tally.mismatches += census_mismatches(specs[name], payloads[name]["config"], predictions[name], results)
        tally.ran = features_ran(results)
    return tallies


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else LAUNCHES
    names = sys.argv[2:] or list(CASES)
    started, machine, at_start = time.perf_counter(), machine_text(), run_start()
    tallies = soak(names, launches)

    def total(attr: str) -> int:
        return sum(len(getattr(t, attr)) if isinstance(getattr(t, attr), list) else getattr(t, attr)
                   for t in tallies.values())

    print(results_header("Soak: executor `mist` launched again and again on CPU ranks", COMMAND,
                         "none: counts crashes, hangs and census mismatches; no reference data", machine=machine,
                         started=at_start))
    print(f"{time.perf_counter() - started:.0f} s in all. Each launch: {WARMUP_STEPS} warm-up and {TIMED_STEPS} timed "
          f"steps, the peak-memory step, the step census and the model-state census, as `mist-ds measure` runs them.\n")
    print(f"**{total('launches')} launches: {total('crashes')} crashes, {total('hangs')} hangs, "
          f"{total('mismatches')} census mismatches.**\n")
    print(table_text(["case", "ranks", "launches", "crashes", "hangs", "census mismatches", "median s",
                      "what ran (from the engines)"],
                     [[name, CASES[name][0], t.launches, len(t.crashes), t.hangs, len(t.mismatches),
                       f"{statistics.median(t.seconds):.0f}", t.ran or "no launch finished"]
                      for name, t in tallies.items()]))
    print(soak_footer({name: t.crashes + t.mismatches for name, t in tallies.items()},
                      {name: CASES[name][1] for name in tallies}))


if __name__ == "__main__":
    main()
