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
in a process of its own, forked from a server that has done none: `at_each_degree` asks the planning process's one
AutoTP server (`python -c ...serve_requests()`, started at its first call and alive while that process is), which
imported torch, transformers, DeepSpeed and the children's modules once (about 5 s on this project's 2-core VM), and
forks a child per degree for each request; so the set-up of one degree never meets another's and the imports are
paid once per planning process, not once per config. `autotp_shapes` (rank 0's parameter elements by part, read for
the specs by mist_ds/specs/autotp_worker.py) and mist_ds/symbolic/hf_trace.py (the trace of the sharded layers) both
run that way.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTOTP_DEGREES = (2, 4, 8)
"""The tensor-parallel degrees priced for a Hugging Face model (AutoTP keeps TP inside a node)."""
WORKER_MODULE = "mist_ds.specs.autotp_worker"
WORKER_FILE = Path(__file__).with_name("autotp_worker.py")
"""The children's side of `autotp_shapes`: a module of its own, since it builds the model with specs/hf.py, which
reads these shapes through `cached_autotp_shapes` (no import circle); part of the cache key as this file is."""
SERVER_MODULES = (WORKER_MODULE, "mist_ds.symbolic.hf_trace")
"""What the AutoTP server imports when it starts: the modules `at_each_degree`'s children run (named, not imported:
this layer never imports the symbolic one)."""


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
    """{degree: entry_module.answer_at(request, degree)}, each computed in a fresh child of this process's AutoTP
    server (module docstring), all degrees at once, in this process's environment at the call (DS_ACCELERATOR
    defaulting to cpu, OMP_NUM_THREADS 1); `request` and the answers travel as JSON files. RuntimeError naming `what`,
    the degree and the child's output (its traceback) where a degree failed. No timeout, as a child's work ends."""
    environment = _environment()
    with tempfile.TemporaryDirectory(prefix="mist_ds_autotp_") as tmp:
        Path(tmp, "request.json").write_text(json.dumps(request))
        server = _server(os.getpid())
        if server.process.poll() is not None:  # it died since the last call (interrupted): another one
            _server.cache_clear()
            server = _server(os.getpid())
        if not server.ask({"entry_module": entry_module, "folder": tmp, "degrees": list(degrees),
                           "environment": environment}):
            _server.cache_clear()  # it died (its log says why): the next call starts another
        answers = {}
        for degree in degrees:
            answer, output = Path(tmp, f"answer{degree}.json"), Path(tmp, f"output{degree}.txt")
            if not answer.exists():
                said = output.read_text(errors="replace") if output.exists() else server.log_tail()
                raise RuntimeError(f"{what} at t = {degree} failed:\n{said[-3000:]}")
            answers[degree] = json.loads(answer.read_text())
    return answers


def _environment() -> dict:
    """This process's environment, as the server and each child get it (DeepSpeed on the CPU unless told otherwise,
    one thread: the meta model computes nothing)."""
    return {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}


class _Server:
    """The AutoTP server's process: requests as JSON lines on its input, "done" on its output once a request's
    children have ended, its own output (import messages, a crash) in `log`."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()
        self.lock = threading.Lock()  # one request at a time on the pipes
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from mist_ds.specs.autotp import serve_requests; serve_requests()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=_environment(), text=True)

    def ask(self, request: dict) -> bool:
        """Whether the server answered `request` (False: it has died)."""
        with self.lock:
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                return self.process.stdout.readline() == "done\n"
            except (BrokenPipeError, OSError):
                return False

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:].decode(errors="replace")


@functools.lru_cache(maxsize=None)
def _server(pid: int) -> _Server:
    """This process's AutoTP server, started at its first use. Cached (the only state kept here) so that its imports
    are paid once per process; keyed by the process id so that a forked process starts its own. It ends when its input
    closes, i.e. when this process exits."""
    return _Server()


def serve_requests() -> None:
    """The AutoTP server (module docstring): imports SERVER_MODULES, then for each request line (entry_module, folder,
    degrees, environment) runs the module's `prepare(request)` (imports every child needs, e.g. the model's class) and
    forks a child per degree that writes `answer_at(request, degree)` to the folder's answer<degree>.json and its
    output to output<degree>.txt; "done" once the children have ended. Ends when its input closes."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # printed messages go to the log, never into the protocol
    for name in SERVER_MODULES:
        with contextlib.suppress(ImportError):  # a child that needs it meets the error again, and reports it
            importlib.import_module(name)
    _import_what_sharding_uses()
    for line in sys.stdin:
        ask = json.loads(line)
        folder = Path(ask["folder"])
        request = json.loads((folder / "request.json").read_text())
        os.environ.clear()
        os.environ.update(ask["environment"])  # the caller's at its call (its cache folder included), as forks inherit
        with contextlib.suppress(Exception):  # a failure here is met again, and reported, by each child
            importlib.import_module(ask["entry_module"]).prepare(request)
        children = [_fork_degree(ask["entry_module"], request, folder, degree) for degree in ask["degrees"]]
        for pid in children:
            os.waitpid(pid, 0)
        protocol.write("done\n")
        protocol.flush()


def _fork_degree(entry_module: str, request: dict, folder: Path, degree: int) -> int:
    """The pid of a child that runs one degree: its global set-up, then exit without running the server's clean-up."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        with open(folder / f"output{degree}.txt", "w") as output:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
                os.dup2(output.fileno(), stream.fileno())
        answer = folder / f"answer{degree}.json"
        temporary = answer.with_suffix(".tmp")
        temporary.write_text(json.dumps(importlib.import_module(entry_module).answer_at(request, degree)))
        os.replace(temporary, answer)  # a failed child leaves no answer
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the output the caller quotes
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _import_what_sharding_uses() -> None:
    """DeepSpeed's modules `shard_with_autotp` reads, and transformers, imported before any fork so no child pays."""
    import deepspeed.module_inject  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.tensor_parallel.config  # noqa: F401
    import transformers  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401
