"""A sweep's summary: each job's result (result.json, written by the job itself) and the sweep's table of
them (sweep.csv, sweep.md), assembled by the end-of-sweep callback (mist_ds/cli/sweep.py) from the job
dirs, so jobs may run in other processes or on other machines.

A tune job's row: its status (the CLI's exit status: 0 planned, 2 bad input, 3 no plan fits) and reason,
the model and cluster, and for a plan its iteration time, tokens/s, MFU, the largest stage peak memory
beside the usable memory, GPUs and, where the cluster has `price_per_gpu_hour`, the cost of a million
tokens. A training job's row (the deepspeed sweep launcher) carries its run.json's numbers instead.
Per model the best rows are marked: `fastest` (most tokens/s) and `cheapest` (fewest USD per million
tokens, among priced rows).
"""
from __future__ import annotations

import csv
import io
from typing import Any, Sequence

from mist_ds.plan import Plan
from mist_ds.specs import Specs
from mist_ds.specs.strategy import degrees_text
from mist_ds.specs.cluster import GIB

RESULT_FILE = "result.json"
SECONDS_PER_HOUR = 3600.0
TOKENS_PER_PRICED_UNIT = 1e6
"""Cost is quoted per million tokens."""
COLUMNS = ("job", "status", "best", "model", "cluster", "gpu", "gpus", "layout", "iteration_time_s", "tokens_per_s",
           "mfu", "peak_memory_gib", "usable_memory_gib", "price_per_gpu_hour", "usd_per_million_tokens",
           "overrides", "reason")
"""The summary's columns, in order; a row's other keys (a training job's) follow them."""
FASTEST, CHEAPEST = "fastest", "cheapest"


def usd_per_million_tokens(price_per_gpu_hour: float | None, gpus: int, tokens_per_s: float) -> float | None:
    """What a million tokens cost on `gpus` GPUs at `price_per_gpu_hour` USD each; None without a price."""
    if price_per_gpu_hour is None:
        return None
    return price_per_gpu_hour * gpus / SECONDS_PER_HOUR / tokens_per_s * TOKENS_PER_PRICED_UNIT


def tune_result(overrides: Sequence[str], status: int, reason: str | None = None, specs: Specs | None = None,
                plan: Plan | None = None) -> dict[str, Any]:
    """A tune job's row: its status and reason; the model and cluster once its config composed (`specs`);
    the plan's numbers when it found one (`plan`)."""
    row: dict[str, Any] = {"status": status, "reason": reason, "overrides": " ".join(overrides)}
    if specs is not None:
        cluster = specs.cluster
        row |= {"model": specs.model.name, "cluster": cluster.name, "gpu": cluster.gpu.name, "gpus": cluster.num_gpus,
                "usable_memory_gib": cluster.gpu.usable_memory_bytes / GIB,
                "price_per_gpu_hour": cluster.price_per_gpu_hour}
    if plan is not None and specs is not None:
        p = plan.prediction
        row |= {"layout": degrees_text(plan.strategy.parallelism), "iteration_time_s": p["iteration_time_s"],
                "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"],
                "peak_memory_gib": max(p["peak_memory_bytes"]) / GIB,
                "usd_per_million_tokens": usd_per_million_tokens(specs.cluster.price_per_gpu_hour,
                                                                 specs.cluster.num_gpus, p["tokens_per_s"])}
    return row


def mark_best(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with `best` set: per model, the fastest row and the cheapest priced row (module docstring)."""
    marked = [{**row, "best": ""} for row in rows]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for row in marked:
        if row.get("status") == 0 and row.get("tokens_per_s") is not None:
            by_model.setdefault(str(row.get("model")), []).append(row)
    for candidates in by_model.values():
        fastest = max(candidates, key=lambda r: r["tokens_per_s"])
        fastest["best"] = FASTEST
        priced = [r for r in candidates if r.get("usd_per_million_tokens") is not None]
        if priced:
            cheapest = min(priced, key=lambda r: r["usd_per_million_tokens"])
            cheapest["best"] = ", ".join(filter(None, (cheapest["best"], CHEAPEST)))
    return marked


def columns_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    present = {key for row in rows for key in row}
    extra = [key for row in rows for key in row if key not in COLUMNS]
    return [c for c in COLUMNS if c in present] + list(dict.fromkeys(extra))


def render_csv(rows: Sequence[dict[str, Any]]) -> str:
    """sweep.csv: one row per job, full precision, empty cells for what a job does not have."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns_of(rows), lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return " ".join(str(value).split()).replace("|", "\\|")


def render_md(rows: Sequence[dict[str, Any]], title: str) -> str:
    """sweep.md: the table of sweep.csv without its empty columns; numbers under 1,000 to 4 significant digits,
    larger ones whole, with thousands separators."""
    columns = [c for c in columns_of(rows) if any(row.get(c) not in (None, "") for row in rows)]
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _model_of(overrides: Sequence[str]) -> str | None:
    """The model group option among Hydra overrides (the last one wins, as in Hydra)."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("model=")]
    return chosen[-1] if chosen else None


def train_result(overrides: Sequence[str], status: int, reason: str | None,
                 record: dict[str, Any] | None) -> dict[str, Any]:
    """A training job's row from its run.json (`record`, mist_ds/runtime/training.py run_record): steps,
    first and last loss, the median step time and tokens/s over the steps that were not census steps,
    the ranks, and the plan's predicted iteration time when it trained a plan."""
    row: dict[str, Any] = {"status": status, "reason": reason, "overrides": " ".join(overrides)}
    if record is None:
        return row
    plan = record.get("plan") or {}
    model = _model_of([*plan.get("user_overrides", []), *overrides]) if plan else _model_of(overrides)
    timed = [s for s in record["steps"] if not s.get("counted")]
    losses = [s["loss"] for s in record["steps"]]
    prediction = record.get("prediction") or {}
    return row | {"model": model, "ranks": len(record["ranks"]), "steps": len(record["steps"]),
                  "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                  "step_time_s": _median([s["time_s"] for s in timed]),
                  "tokens_per_s": _median([s["tokens_per_s"] for s in timed]),
                  "predicted_iteration_time_s": prediction.get("iteration_time_s")}
