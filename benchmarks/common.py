"""Shared helpers of the benchmarks: reference rows, fast specs building, error metrics, the specs of
the SC'21 and vTrain reference rows, and the text of tuner reports (plans, machine, source commit).

Rows are priced without Hydra per row: one `compose` per model shape, then specs are derived with
dataclasses.replace and `resolve_strategy` (the same validation the CLI runs).
"""
from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
from scipy.stats import spearmanr

from mist_ds.config import compose
from mist_ds.cost.predict import Prediction, model_costs, predict_strategy
from mist_ds.hardware import hardware_model
from mist_ds.specs import ExecutorCapabilities, Specs
from mist_ds.specs.strategy import StrategyRequest, layout_text, resolve_strategy

if TYPE_CHECKING:
    from mist_ds.tuner.search import PointResult

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE = REPO_ROOT / "benchmarks" / "reference"


def reference_rows(name: str) -> list[dict[str, str]]:
    """Rows of benchmarks/reference/<name>.csv (copied from the project's shared reference data)."""
    with open(REFERENCE / f"{name}.csv") as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


@lru_cache(maxsize=None)
def base_specs(overrides: tuple[str, ...]) -> Specs:
    return compose(list(overrides), with_strategy=False)


def specs_for(overrides: tuple[str, ...], *, nodes: int, gpus_per_node: int, global_batch: int,
              cluster_changes: dict | None = None, gpu_changes: dict | None = None, **strategy) -> Specs:
    base = base_specs(overrides)
    gpu = dataclasses.replace(base.cluster.gpu, **(gpu_changes or {}))
    cluster = dataclasses.replace(base.cluster, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                                  **(cluster_changes or {}))
    train = dataclasses.replace(base.train, global_batch_size=global_batch)
    defaults = dict(runtime="megatron", dp=None, grad_accum=None, layers_per_stage=None, ckpt_layers="none",
                    zero_stage=0, offload={}, schedule="1f1b", allow_cross_node_tp=False)
    resolved = resolve_strategy(base.model, cluster, train, StrategyRequest(**{**defaults, **strategy}))
    return dataclasses.replace(base, cluster=cluster, train=train, strategy=resolved)


_costs: dict = {}


def predict_specs(specs: Specs, caps: ExecutorCapabilities | None = None) -> Prediction:
    """predict of `specs`, on `caps` where given (an ablation), else on the runtime the strategy names."""
    key = (specs.model, specs.train.precision)
    if key not in _costs:
        _costs[key] = model_costs(specs)
    return predict_strategy(specs, _costs[key], hardware_model(specs.cluster, specs.train.precision), caps)


def mape(predicted, measured) -> float:
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    return float(np.mean(np.abs(predicted - measured) / measured))


def spearman(predicted, measured) -> float:
    if len(predicted) < 2:
        return float("nan")
    return float(spearmanr(predicted, measured).statistic)


def top1_regret(predicted, measured) -> float:
    """How much slower the predicted-best configuration really was than the measured best."""
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    return float(measured[np.argmin(predicted)] / measured.min() - 1.0)


# --- the reference rows' specs -----------------------------------------------------------------------------

# Layers per model chunk (--num-layers-per-virtual-pipeline-stage) of the rows the paper's script
# (Megatron-LM examples/sc21/run_table_1.sh) runs interleaved; every other row, 1T included, runs 1F1B.
SC21_LAYERS_PER_CHUNK = {"76.1B": 5, "145.6B": 5, "310.1B": 3, "529.6B": 1}


def sc21_virtual_stages(row: dict) -> int:
    """Chunks per stage the paper ran (1: plain 1F1B)."""
    if row["model"] not in SC21_LAYERS_PER_CHUNK:
        return 1
    return int(row["num_layers"]) // int(row["pp"]) // SC21_LAYERS_PER_CHUNK[row["model"]]


def sc21_row_specs(row: dict, interleaved: bool = True) -> Specs:
    """Specs of a row of benchmarks/reference/megatron_sc21_table1.csv: the published layout on runtime
    megatron, full recompute, ZeRO 0, the paper's interleaving (`interleaved`) or plain 1F1B."""
    overrides = ("model=gpt3-1.3b", f"model.name=gpt-{row['model']}", f"model.hidden_size={row['hidden_size']}",
                 f"model.num_layers={row['num_layers']}", f"model.num_heads={row['num_heads']}",
                 "model.vocab_size=51200", "model.seq_len=2048", "model.flash_attention=false",
                 "model.dropout=0.1",  # Megatron-LM defaults: attention and hidden dropout 0.1
                 "cluster=a100-80g", "train.precision=fp16")
    gpus = int(row["gpus"])
    return specs_for(overrides, nodes=gpus // 8, gpus_per_node=8, global_batch=int(row["global_batch"]),
                     runtime="megatron", tp=int(row["tp"]), pp=int(row["pp"]), micro_batch_size=int(row["micro_batch"]),
                     ckpt_layers="full", zero_stage=0, **_sc21_schedule(row, interleaved))


def _sc21_schedule(row: dict, interleaved: bool) -> dict:
    chunks = sc21_virtual_stages(row) if interleaved else 1
    return {"schedule": "interleaved", "virtual_stages": chunks} if chunks > 1 else {}


VTRAIN_FIT_GPUS = {2, 4}  # the calibration subset of cluster/a100-80g.yaml; 8-GPU rows are held out


def vtrain_row_overrides(row: dict) -> list[str]:
    """The Hydra overrides of a vTrain row: the specs vtrain_row_specs builds, as `mist_ds.predict` takes them."""
    return ["model=gpt3-1.3b", f"model.name=vtrain-h{row['hidden_size']}-l{row['num_layers']}",
            f"model.hidden_size={row['hidden_size']}", f"model.num_layers={row['num_layers']}",
            f"model.num_heads={row['num_heads']}", "model.vocab_size=51200", f"model.seq_len={row['seq_len']}",
            "model.flash_attention=false", "cluster=a100-80g", "train.precision=fp16", "model.dropout=0.1",
            "cluster.nodes=1", f"cluster.gpus_per_node={row['gpus']}", f"train.global_batch_size={row['global_batch']}",
            "strategy.runtime=megatron", f"strategy.tp={row['tp']}", f"strategy.pp={row['pp']}",
            f"strategy.micro_batch_size={row['micro_batch']}", "strategy.ckpt_layers=full", "strategy.zero_stage=0"]


def vtrain_row_specs(row: dict, **gpu_changes) -> Specs:
    """Specs of a row of benchmarks/reference/vtrain_a100_single_node.csv (runtime megatron, one node, full
    recompute, ZeRO 0); `gpu_changes` replace fields of the cluster's GPU."""
    overrides = ("model=gpt3-1.3b", f"model.name=vtrain-h{row['hidden_size']}-l{row['num_layers']}",
                 f"model.hidden_size={row['hidden_size']}", f"model.num_layers={row['num_layers']}",
                 f"model.num_heads={row['num_heads']}", "model.vocab_size=51200", f"model.seq_len={row['seq_len']}",
                 "model.flash_attention=false", "cluster=a100-80g", "train.precision=fp16",
                 "model.dropout=0.1")  # Megatron-DeepSpeed defaults: attention and hidden dropout 0.1
    return specs_for(overrides, nodes=1, gpus_per_node=int(row["gpus"]), global_batch=int(row["global_batch"]),
                     gpu_changes=gpu_changes or None, runtime="megatron", tp=int(row["tp"]), pp=int(row["pp"]),
                     micro_batch_size=int(row["micro_batch"]), ckpt_layers="full", zero_stage=0)


# --- tuner reports -----------------------------------------------------------------------------------------

def plan_text(best: PointResult) -> str:
    """One line of a tuned plan: the one layout text every report prints (docs/design.md, Glossary)."""
    return layout_text(best.strategy)


def source_tree(paths: tuple[str, ...] = ("mist_ds", "benchmarks", "pyproject.toml")) -> str:
    """The commit the numbers come from, and which of `paths` had uncommitted changes. benchmarks/results/ is
    left out: a run redirected into its results file has already emptied that file when this is asked."""
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True,  # noqa: E731
                                       text=True).stdout.strip()
    changed = git("status", "--porcelain", "--", *paths, ":(exclude)benchmarks/results").splitlines()
    dirty = sorted({line.split(maxsplit=1)[1] for line in changed if not line.startswith("??")})
    return f"{git('rev-parse', '--short', 'HEAD')} " + (
        f"(dirty: uncommitted changes to {', '.join(dirty)})" if dirty else "(clean)")


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo), else what platform reports."""
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


def deepspeed_version() -> str:
    """DeepSpeed's version, read from its package metadata without importing it: `import deepspeed` picks an
    accelerator and, with neither DS_ACCELERATOR nor a GPU, logs a warning through its logger's handler on
    stdout, which a benchmark's results file would capture."""
    return importlib.metadata.version("deepspeed")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages now: the machine is shared, and its load moves every timing."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def load_span(at_start: str) -> str:
    """The Load field of a run that read `at_start` (load_average()) when it began and ends now."""
    return f"load average at start {at_start}, at the end {load_average()} (1, 5, 15 minutes)"


def machine_description() -> str:
    """The machine in words: cores, CPU model, Python and numpy (the load is a header field of its own)."""
    return (f"{os.cpu_count()}-core VM ({cpu_model()}), Python {platform.python_version()}, numpy {np.__version__}, "
            "single process (tuner.workers=1)")


# --- the header every results file starts with ---------------------------------------------------------------

HEADER_FIELDS = ("Command", "Commit", "Machine", "Load", "Data")
# fitted: the numbers were fitted on these rows; validation: reference rows looked at while the model changed;
# held out: rows nobody tuned against; none: no reference data (a speed, stability or plan-only result).
DATA_KINDS = ("fitted", "validation", "held out", "none")


@dataclasses.dataclass(frozen=True)
class RunStart:
    """What the header of a run that prints it at its end records as the run begins: the commit (a tree edited
    during a long run would be misreported) and the load average."""
    commit: str
    load: str


def run_start() -> RunStart:
    return RunStart(source_tree(), load_average())


def results_header(title: str, command: str, data: str, *, machine: str | None = None, load: str | None = None,
                   commit: str | None = None, started: RunStart | None = None) -> str:
    """The header of a results file: its title, then one line per HEADER_FIELDS field, which the index
    (benchmarks/index.py) and tests/test_benchmarks.py read. `data` starts with DATA_KINDS joined by ' and '
    (what part of the file is which, after a colon); `load` defaults to the load average as the header is
    written; a script that prints its header after the run passes `started` (run_start() as it began), whose
    commit and load at start the header records, with the load at the end."""
    if started is not None:
        commit, load = commit or started.commit, load or load_span(started.load)
    kinds = data.split(":", 1)[0].split(" and ")
    if not all(kind in DATA_KINDS for kind in kinds):
        raise ValueError(f"data must start with {' and '.join(DATA_KINDS)}, joined by ' and ': {data!r}")
    return "\n".join([f"# {title}", "",
                      f"Command: `{command}`  ",
                      f"Commit: {commit or source_tree()}  ",
                      f"Machine: {machine or machine_description()}  ",
                      f"Load: {load or 'load average ' + load_average() + ' (1, 5, 15 minutes) as the run started'}  ",
                      f"Data: {data}", ""])


def soak_footer(failed: dict[str, list[str]], cases: dict[str, Sequence[str]]) -> str:
    """A soak's end: each case's distinct failure lines (crashes, mismatches), if any, then the cases' overrides."""
    lines = [f"- {name}: {line}" for name, found in failed.items() for line in dict.fromkeys(found)]
    failures = "\nWhat failed (distinct lines):\n\n" + "\n".join(lines) + "\n" if lines else ""
    listed = "; ".join(f"{name}: {' '.join(overrides)}" for name, overrides in cases.items())
    return failures + f"\nCases: {listed}."


@dataclasses.dataclass
class SoakTally:
    """One soak case's launches: what failed how (seconds per launch)."""

    launches: int = 0
    crashes: list[str] = dataclasses.field(default_factory=list)
    hangs: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)


def table_text(header: list[str], rows: list[list]) -> str:
    """A markdown table: the header, its rule, one line per row (cells as str() gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])

