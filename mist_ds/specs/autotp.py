"""DeepSpeed AutoTP applied to a Hugging Face model as DeepSpeed's training engine applies it, on the meta device,
in a process of its own (docs/design.md, Your own model).

`deepspeed.initialize` with `"tensor_parallel": {"autotp_size": t}` shards the model in
`DeepSpeedEngine._apply_autotp_partitioning` (runtime/engine.py): by the config's `partition_config` if given, else
by the model's Hugging Face `tp_plan`, else by AutoTP's heuristic (module_inject/auto_tp.py); column-parallel
linears all-reduce their input gradient, row-parallel ones their output, an LM head sharded by column with gathered
output all-gathers the logits, a tied embedding may become vocabulary-parallel. `shard_with_autotp` runs exactly
that method on a meta model, in a process whose default group is torch's single-process "fake" backend of world
size t (collectives are no-ops there; ranks are rank 0's view), after the same set-up the engine runs first
(training mode, the tensor-parallel mesh, the runtime configuration). Every tensor then has rank 0's shape, the
largest share where AutoTP shards unevenly (DeepSpeed gives the first ranks the remainders), so the cost of rank 0
is the slowest rank's.

That set-up is global to a process (torch's default group, DeepSpeed's groups and AutoTP mode), so each degree runs
in a process of its own: `at_each_degree` spawns one process that imports torch, transformers and DeepSpeed once
(about 5 s on this project's 2-core VM) and forks a child per degree, so the set-up of one degree never meets
another's and the imports are paid once. `autotp_shapes` (rank 0's parameter elements by part, read for the specs
by the spawned mist_ds/specs/autotp_worker.py) and mist_ds/symbolic/hf_trace.py (the trace of the sharded layers)
both run that way.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

AUTOTP_DEGREES = (2, 4, 8)
"""The tensor-parallel degrees priced for a Hugging Face model (AutoTP keeps TP inside a node)."""
WORKER_MODULE = "mist_ds.specs.autotp_worker"
WORKER_FILE = Path(__file__).with_name("autotp_worker.py")
"""The spawned side of `autotp_shapes`: a module of its own, since it builds the model with specs/hf.py, which
reads these shapes through `cached_autotp_shapes` (no import circle); part of the cache key as this file is."""


class _EngineStandIn:
    """What `DeepSpeedEngine._apply_autotp_partitioning` reads of its engine."""

    local_rank = -1

    def __init__(self, degree: int) -> None:
        self.degree = degree

    def autotp_size(self) -> int:
        return self.degree

    def is_deepcompile_enabled(self) -> bool:
        return False

    def compile_autotp(self) -> bool:
        return False


def shard_with_autotp(model, degree: int, tensor_parallel: dict[str, Any] | None = None):
    """Shard `model` (a Hugging Face model, on the meta device) as DeepSpeed's training engine would at autotp_size
    = `degree` with the config's `tensor_parallel` section, seen from rank 0. Joins a fake process group of world
    size `degree` first: call it only in a process of its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    import deepspeed.ops as dsops

    dsops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shared-memory op
    from deepspeed import comm as ds_dist
    from deepspeed.module_inject import set_autotp_mode
    from deepspeed.module_inject.layers import configure_tensor_parallel_runtime
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
    from deepspeed.utils import groups

    ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    config = get_tensor_parallel_config({"tensor_parallel": {**(tensor_parallel or {}), "autotp_size": degree}})
    set_autotp_mode(training=True)  # as deepspeed.initialize does before building the engine
    groups._init_tp_mesh_device(tensor_model_parallel_size=degree)
    configure_tensor_parallel_runtime(config)
    DeepSpeedEngine._apply_autotp_partitioning(_EngineStandIn(degree), model, config)
    return model


@dataclass(frozen=True)
class AutoTpShapes:
    """Rank 0's parameter elements under AutoTP at one degree, or why AutoTP refused the model."""

    degree: int
    embedding: int = 0
    block: int = 0
    head: int = 0
    largest_block_tensor: int = 0
    vocab_tensor: int = 0
    refused: str = ""
    """AutoTP's own error (e.g. an architecture it does not support), empty when it shards the model."""


def cached_autotp_shapes(config_json: str, attn_implementation: str, blocks_attr: str) -> tuple[AutoTpShapes, ...]:
    """autotp_shapes at AUTOTP_DEGREES, read once per machine (the cache folder's `autotp/`, keyed by the config,
    the attention implementation and the versions of DeepSpeed, transformers and torch)."""
    import hashlib
    from importlib.metadata import version

    from mist_ds.specs.cache_root import cached_json

    keyed = {"config": config_json, "attn_implementation": attn_implementation, "blocks_attr": blocks_attr,
             "degrees": AUTOTP_DEGREES, **{name: version(name) for name in ("deepspeed", "transformers", "torch")},
             "code": hashlib.sha256(b"".join(Path(f).read_bytes() for f in (__file__, WORKER_FILE))).hexdigest()}
    read = lambda: [entry.__dict__ for entry in autotp_shapes(config_json, attn_implementation, blocks_attr)]  # noqa
    return cached_json("autotp", keyed, read, lambda entries: tuple(AutoTpShapes(**entry) for entry in entries))


def autotp_shapes(config_json: str, attn_implementation: str, blocks_attr: str,
                  degrees: tuple[int, ...] = AUTOTP_DEGREES) -> tuple[AutoTpShapes, ...]:
    """AutoTpShapes at each degree, each read in a process of its own (module docstring)."""
    request = {"config_json": config_json, "attn_implementation": attn_implementation, "blocks_attr": blocks_attr}
    answers = at_each_degree(WORKER_MODULE, request, degrees, "reading AutoTP's shards")
    return tuple(AutoTpShapes(**answers[degree]) for degree in degrees)


def at_each_degree(entry_module: str, request: dict, degrees, what: str) -> dict[int, dict]:
    """{degree: answer} from `python -m entry_module`, one spawned process whose module runs `serve_each_degree`
    with `request` (JSON); RuntimeError naming `what`, the degree and the process's output where a degree failed."""
    environment = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="mist_ds_autotp_") as tmp:
        Path(tmp, "request.json").write_text(json.dumps(request))
        done = subprocess.run([sys.executable, "-m", entry_module, tmp, ",".join(map(str, degrees))], env=environment,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        answers = {}
        for degree in degrees:
            answer = Path(tmp, f"answer{degree}.json")
            if not answer.exists():
                raise RuntimeError(f"{what} at t = {degree} failed:\n{done.stdout[-3000:]}")
            answers[degree] = json.loads(answer.read_text())
    return answers


def serve_each_degree(argv: list[str], prepare: Callable[[dict], None], work: Callable[[dict, int], dict]) -> None:
    """The spawned side of `at_each_degree` (argv: folder, degrees joined by commas): `prepare(request)` once (the
    imports and whatever the children share), then a forked child per degree writes `work(request, degree)`; the
    children run at once and the process exits 1 if one failed (its traceback on the output)."""
    folder, degrees = Path(argv[1]), [int(text) for text in argv[2].split(",")]
    request = json.loads((folder / "request.json").read_text())
    prepare(request)
    _import_what_sharding_uses()
    children = []
    for degree in degrees:
        pid = os.fork()
        if pid == 0:  # the child: one degree's global set-up, then exit without running the parent's clean-up
            code = 1
            try:
                answer = folder / f"answer{degree}.json"
                temporary = answer.with_suffix(".tmp")
                temporary.write_text(json.dumps(work(request, degree)))
                os.replace(temporary, answer)  # a failed child leaves no answer
                code = 0
            except BaseException:  # noqa: BLE001 - reported on the output the caller quotes
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    sys.exit(1 if any(codes) else 0)


def _import_what_sharding_uses() -> None:
    """DeepSpeed's modules `shard_with_autotp` reads, imported before the fork so no child pays for them."""
    import deepspeed.module_inject  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.tensor_parallel.config  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401
