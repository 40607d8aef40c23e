"""`mist-ds measure`: the prediction beside what the plan's engines did, in one record per run, and the
accuracy table the records accumulate into (JSON lines, and a markdown table rebuilt from them).

Record keys (public interface): `predicted_` and `measured_` + `iteration_time_s`, `model_state_bytes`,
`peak_memory_bytes`, `flops`, `comm_bytes`, each a list with one entry per rank (a rank's predicted
values are its stage's); `comm_bytes` entries map "kind/group" to bytes; plus `strategy`, `model`,
`cluster`, `world_size`, `warmup`, `steps`, `time_error` (measured / predicted - 1), and `what_ran`, per
rank what its engine ran, read from the live objects (mist_ds/observe/report.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from mist_ds.cost.predict import Prediction
from mist_ds.files import write_atomic
from mist_ds.specs import Specs
from mist_ds.specs.groups import stage_of
from mist_ds.specs.strategy import layout_text, strategy_from_dict


def measure_record(specs: Specs, prediction: Prediction, results: list[dict[str, Any]], warmup: int,
                   steps: int) -> dict[str, Any]:
    par = specs.strategy.parallelism
    stages = [stage_of(par, rank) for rank in range(par.num_gpus)]
    measured_time = statistics.median(r["iteration_time_s"] for r in results)
    return {
        "model": specs.model.name, "cluster": specs.cluster.name, "world_size": par.num_gpus,
        "strategy": specs.strategy.to_dict(), "warmup": warmup, "steps": steps,
        "predicted_iteration_time_s": [prediction.iteration_time_s] * par.num_gpus,
        "measured_iteration_time_s": [r["iteration_time_s"] for r in results],
        "predicted_model_state_bytes": [prediction.model_state_bytes[i] for i in stages],
        "measured_model_state_bytes": [r["model_state_bytes"] for r in results],
        "predicted_peak_memory_bytes": [prediction.peak_memory_bytes[i] for i in stages],
        "measured_peak_memory_bytes": [r["peak_memory_bytes"] for r in results],
        "predicted_flops": [prediction.flops_per_rank[i] for i in stages],
        "measured_flops": [r["flops"] for r in results],
        "predicted_comm_bytes": [prediction.comm_bytes_per_rank[i] for i in stages]
        if prediction.comm_bytes_per_rank is not None else None,
        "measured_comm_bytes": [r["comm_bytes"] for r in results],
        "time_error": measured_time / prediction.iteration_time_s - 1.0,
        "what_ran": [r["what_ran"] for r in results],
    }


def _layout(strategy: dict) -> str:
    """A measure record's strategy (its one serialization) as the one layout text."""
    return layout_text(strategy_from_dict(strategy, "measure.strategy"))


def render_measure(record: dict[str, Any]) -> str:
    lines = [f"{record['model']} on {record['world_size']} ranks ({record['cluster']}): {_layout(record['strategy'])}",
             f"iteration: predicted {record['predicted_iteration_time_s'][0]:.4f} s, measured median "
             f"{statistics.median(record['measured_iteration_time_s']):.4f} s ({record['time_error']:+.1%})"]
    for rank in range(record["world_size"]):
        lines.append(f"rank {rank}: FLOPs {record['measured_flops'][rank]:,} measured / "
                     f"{record['predicted_flops'][rank]:,.0f} predicted; peak memory "
                     f"{record['measured_peak_memory_bytes'][rank]:,} measured / "
                     f"{record['predicted_peak_memory_bytes'][rank]:,.0f} predicted bytes")
    return "\n".join(lines)


def append_to_table(path: Path, record: dict[str, Any]) -> list[Path]:
    """Append the record to `path` (JSON lines) and rebuild the markdown table beside it (.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = path.read_text() if path.exists() else ""
    write_atomic(path, previous + json.dumps(record, allow_nan=False) + "\n")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = ["| model | ranks | layout | predicted s | measured s | error |", "|---|---|---|---|---|---|"]
    for r in records:
        rows.append(f"| {r['model']} | {r['world_size']} | {_layout(r['strategy'])} | "
                    f"{r['predicted_iteration_time_s'][0]:.4f} | "
                    f"{statistics.median(r['measured_iteration_time_s']):.4f} | "
                    f"{r['time_error']:+.1%} |")
    table = path.with_suffix(".md")
    write_atomic(table, "\n".join(rows) + "\n")
    return [path, table]
