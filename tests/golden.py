"""Golden record of what the planner computes: `predict --json` over many settings on every runtime,
tuned plans for a handful, and the DeepSpeed keys emitted for them.

A refactor that should not change numbers is checked against `tests/golden/golden.json`
(tests/test_golden.py). Recorded once, before such a refactor:

    DS_ACCELERATOR=cpu .venv/bin/python -m tests.golden     # rewrites tests/golden/golden.json

Re-record only for a change that is meant to move numbers, and say so in the commit.
Strategies are recorded in a form that outlives a change of their serialization: a prediction's
`strategy` dict as recorded must be contained in the new one, and a plan's strategy is compared as
the validated StrategySpec its overrides compose to.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

GOLDEN_FILE = Path(__file__).resolve().parent / "golden" / "golden.json"

# (name, overrides): model, cluster and batch; each is combined with every strategy below.
SETTINGS = (
    ("tiny-cpu", ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=8", "train.global_batch_size=64"]),
    ("gpt13-l4", ["model=gpt3-1.3b", "cluster=l4-24g", "train.global_batch_size=64"]),
    ("llama8-a100x2", ["model=llama3-8b", "cluster=a100-80g", "cluster.nodes=2", "train.global_batch_size=128"]),
    ("falcon7-h100", ["model=falcon-7b", "cluster=h100-80g", "train.global_batch_size=32", "train.precision=fp16"]),
)

_COMMON = (
    ("dp", []),
    ("zero1", ["strategy.zero_stage=1"]),
    ("zero2", ["strategy.zero_stage=2", "strategy.micro_batch_size=2"]),
    ("zero3", ["strategy.zero_stage=3"]),
    ("tp2-pp2", ["strategy.tp=2", "strategy.pp=2"]),
    ("pp4-full", ["strategy.pp=4", "strategy.ckpt_layers=full"]),
    ("pp2-zero1-full", ["strategy.pp=2", "strategy.zero_stage=1", "strategy.ckpt_layers=full"]),
    ("tp4-b2", ["strategy.tp=4", "strategy.micro_batch_size=2"]),
    ("pp2-uneven", ["strategy.pp=2", "strategy.layers_per_stage=UNEVEN"]),
    ("fp32", ["train.precision=fp32", "strategy.pp=2"]),
    ("no-clip", ["train.grad_clip=0", "strategy.zero_stage=1"]),
    ("pp2-zero2", ["strategy.pp=2", "strategy.zero_stage=2"]),
    ("ckpt1", ["strategy.ckpt_layers=1"]),
)
_DEEPSPEED = (
    ("zero1-optoff", ["strategy.zero_stage=1", "strategy.offload.optimizer=1", "strategy.offload.grads=1"]),
    ("zero3-alloff", ["strategy.zero_stage=3", "strategy.offload.weights=1", "strategy.offload.optimizer=1",
                      "strategy.offload.grads=1"]),
    ("pp2-ckpt-one-stage", ["strategy.pp=2", "strategy.ckpt_layers=[0,FIRST]"]),
)
_MIST_PAPER = (
    ("mist-fractions", ["strategy.schedule=mist", "strategy.pp=2", "strategy.zero_stage=[1,2]",
                        "strategy.offload.weights=[0.25,0.5]", "strategy.offload.grads=[0.5,0.5]",
                        "strategy.offload.optimizer=[0.375,1]", "strategy.offload.activations=[0,0.5]",
                        "strategy.ckpt_layers=[1,0]"]),
    ("mist-zero3-pp2", ["strategy.schedule=mist", "strategy.pp=2", "strategy.zero_stage=3", "strategy.tp=2"]),
    ("mist-act-offload", ["strategy.schedule=mist", "strategy.offload.activations=1", "strategy.ckpt_layers=1"]),
)
_MEGATRON = (
    ("interleaved", ["strategy.pp=2", "strategy.schedule=interleaved", "strategy.virtual_stages=2",
                     "strategy.layers_per_stage=EVEN", "strategy.grad_accum=null"]),
    ("uniform-ckpt", ["strategy.pp=2", "strategy.ckpt_layers=1", "strategy.zero_stage=1"]),
    ("optimizer-fraction", ["strategy.zero_stage=1", "strategy.offload.optimizer=0.5"]),
)
STRATEGIES = {
    "deepspeed": _COMMON + _DEEPSPEED,
    "mist": _COMMON + (("mist-schedule", ["strategy.schedule=mist", "strategy.pp=2", "strategy.zero_stage=1"]),),
    "mist-paper": _COMMON + _DEEPSPEED + _MIST_PAPER,
    "megatron": _COMMON + _MEGATRON,
}

# Tuned plans: small enough to tune in seconds each; one with baselines.
SMALL = ["model=tiny", "model.num_layers=7", "cluster=cpu", "cluster.gpus_per_node=3", "cluster.intra_node_gbps=0.005",
         "tuner.micro_batch_sizes=[1,2]", "tuner.layer_slack=1", "train.global_batch_size=48",
         "tuner.weights_offload_ratios=[0]", "tuner.grads_offload_ratios=[0]",
         "tuner.activations_offload_ratios=[0,1]", "tuner.optimizer_offload_ratios=[0,1]"]
TUNES = (
    ("small-baselines", SMALL + ["tuner.quiet=true"]),
    ("small-mist-paper", SMALL + ["tuner.runtime=mist-paper", "tuner.compare_baselines=false", "tuner.quiet=true"]),
    ("gpt13-l4", ["model=gpt3-1.3b", "cluster=l4-24g", "train.global_batch_size=64", "tuner.compare_baselines=false",
                  "tuner.quiet=true"]),
    ("gpt27-l4-mist-paper", ["tuner.runtime=mist-paper", "tuner.compare_baselines=false", "tuner.quiet=true"]),
    ("llama8-a100x2", ["model=llama3-8b", "cluster=a100-80g", "cluster.nodes=2", "train.global_batch_size=128",
                       "tuner.compare_baselines=false", "tuner.quiet=true", "tuner.micro_batch_sizes=[1,2]"]),
    ("tiny-memory-binds", ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "cluster.gpu.memory_gib=0.56",
                           "train.global_batch_size=32", "tuner.compare_baselines=false", "tuner.quiet=true"]),
    ("megatron-space", ["model=gpt3-1.3b", "cluster=a100-40g", "train.global_batch_size=64", "tuner.space=megatron",
                        "tuner.runtime=megatron", "tuner.compare_baselines=false", "tuner.quiet=true"]),
)


def _num_layers(overrides: list[str]) -> int:
    from mist_ds.config import compose

    return compose(overrides, with_strategy=False).model.num_layers


def predict_cases() -> list[tuple[str, list[str]]]:
    """(name, overrides) of every prediction case; placeholders become the setting's layer counts."""
    cases = []
    for setting, base in SETTINGS:
        layers = _num_layers(base)  # one compose per setting, not per setting and runtime
        for runtime, strategies in STRATEGIES.items():
            for name, strategy in strategies:
                filled = [o.replace("UNEVEN", f"[{layers // 2 + 1},{layers - layers // 2 - 1}]")
                          .replace("EVEN", f"[{layers // 2},{layers - layers // 2}]")
                          .replace("FIRST", str(layers - layers // 2)) for o in strategy]
                cases.append((f"{setting}/{runtime}/{name}", [*base, f"strategy.runtime={runtime}", *filled]))
    return cases


@functools.lru_cache(maxsize=1)
def _composer():
    """One composer for every case: the cases share their Hydra composes (mist_ds/config/many.py gives each list
    the Specs, or the ConfigError, that `compose` gives it; tests/test_predict_many.py holds it to that)."""
    from mist_ds.config.many import ManyComposer

    return ManyComposer()


def predict_record(overrides: list[str]) -> dict:
    """predict --json of `overrides`, or the refusal (field and rule) when the strategy is refused."""
    from mist_ds.cost.predict import predict
    from mist_ds.specs import ConfigError

    try:
        return {"prediction": predict(_composer().compose(overrides)).to_dict()}
    except ConfigError as error:
        return {"refused": {"field": error.field, "rule": error.rule}}


def tune_record(overrides: list[str]) -> dict:
    """The plan's strategy overrides, prediction, search statistics (not its seconds), baselines and
    the DeepSpeed keys of its ds_config (the `"mist"` block aside); or the no-fit explanation."""
    from mist_ds.config import compose
    from mist_ds.emit import ds_config
    from mist_ds.specs import executor_capabilities
    from mist_ds.tuner import NoPlanFits, tune_specs

    specs = compose(overrides, with_strategy=False)
    try:
        result = tune_specs(specs, progress=False)
    except NoPlanFits as reason:
        return {"no_plan": str(reason)}
    strategy = result.strategy
    record = {
        "strategy_overrides": strategy_override_strings(strategy),
        "prediction": result.prediction.to_dict(),
        "search": search_statistics(result.search),
        "baselines": [{"space": b.space, "iteration_time_s": b.prediction.iteration_time_s if b.prediction else None,
                       "speedup": b.speedup, "strategy": b.prediction.strategy if b.prediction else None,
                       "search": search_statistics(b.search)} for b in result.baselines],
    }
    if executor_capabilities(strategy.runtime).executes_on_deepspeed:
        record["ds_config"] = {k: v for k, v in ds_config(strategy, specs.train, specs.model).items() if k != "mist"}
    return record


def strategy_override_strings(strategy) -> list[str]:
    """The strategy as `strategy.*` overrides."""
    from mist_ds.specs.strategy import strategy_overrides

    return strategy_overrides(strategy)


def search_statistics(result) -> dict:
    best = result.best
    return {"space": result.space, "runtime": result.runtime, "points_priced": len(result.points),
            "points_pruned": len(result.pruned), "candidates_evaluated": result.candidates,
            "objective_s": best.objective_s if best else None, "gap": best.gap if best else None,
            "solver": best.solver if best else None}


def record() -> dict:
    return {"predict": {name: predict_record(o) for name, o in predict_cases()},
            "tune": {name: {"overrides": o, **tune_record(o)} for name, o in TUNES}}


def main() -> int:
    data = record()
    GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    refused = sum("refused" in r for r in data["predict"].values())
    print(f"wrote {GOLDEN_FILE.name}: {len(data['predict'])} predictions ({refused} refused), "
          f"{len(data['tune'])} plans", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
