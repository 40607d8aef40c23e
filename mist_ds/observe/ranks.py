"""Run a function on N local CPU ranks of real torch.distributed (gloo), with a hard timeout.

`launch(worker, world_size, payload)` starts one child Python in its own session (so a hang is
killed with its whole process group), which spawns the ranks with torch.multiprocessing ('spawn', a
free port picked at run time); each rank calls `worker` ("module:function") as
worker(rank, world_size, payload) and its JSON-able return value comes back, by rank. The
environment is the CPU recipe of docs/design.md (What DeepSpeed does, running on CPU):
DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1, and no JIT-built ops (`init_cpu_distributed`).
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mist_ds.runtime import free_port
from mist_ds.specs.cluster import CPU_RANKS_ENV

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the mist_ds package (the repository in a source checkout): on the ranks' path,
and where JIT builds would land unless TORCH_EXTENSIONS_DIR says otherwise."""
LAUNCH_TIMEOUT_S = 180.0  # one launch runs well under a minute on 2 cores; a hang is killed at this bound
CPU_ENV = CPU_RANKS_ENV


class LaunchTimeout(TimeoutError):
    """A launch ran past its limit; its whole process group (`pgid`) was killed."""

    def __init__(self, message: str, pgid: int):
        super().__init__(message)
        self.pgid = pgid


def launch(worker: str, world_size: int, payload, timeout_s: float = LAUNCH_TIMEOUT_S,
           env: dict | None = None) -> list:
    """Run `worker(rank, world_size, payload)` on `world_size` local ranks; its return values by rank.

    `env`: what the ranks' environment adds (default CPU_ENV, CPU ranks). The child runs in a new
    session: on timeout the whole process group (the child and every rank) is killed, so a
    mis-paired send/recv cannot hang the run.
    """
    env = {**os.environ, **(CPU_ENV if env is None else env), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(SOURCE_ROOT / ".torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="mist_ds_launch_") as tmp:
        Path(tmp, "payload.json").write_text(json.dumps(payload))
        cmd = [sys.executable, "-m", "mist_ds.observe.ranks", worker, str(world_size), tmp]
        code, log = run_in_session(cmd, SOURCE_ROOT, env, timeout_s, f"{worker} on {world_size} ranks")
        if code != 0:
            raise RuntimeError(f"{worker} on {world_size} ranks exited {code}:\n{log[-6000:]}")
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world_size)]


def run_in_session(cmd: list[str], cwd, env: dict, timeout_s: float, what: str) -> tuple[int, str]:
    """(exit code, output) of `cmd` run in a new session; its whole process group is killed if it runs
    past `timeout_s` (LaunchTimeout) or the caller is interrupted, so no rank outlives the call."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
        log, _ = proc.communicate()
        raise LaunchTimeout(f"{what} ran past {timeout_s} s; its process group was killed.\n{log[-4000:]}",
                            pgid=proc.pid) from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, log


def hang_worker(rank: int, world_size: int, payload) -> None:
    """A rank that never returns (as a mis-paired send/recv would): the timeout's test."""
    while True:
        time.sleep(1)


def _rank_main(rank: int, worker: str, world_size: int, tmp: str) -> None:
    """Entry of one spawned rank: the environment torch.distributed's env:// init reads, then the worker."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    module_name, function_name = worker.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    payload = json.loads(Path(tmp, "payload.json").read_text())
    result = function(rank, world_size, payload)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def init_cpu_distributed():
    """Import DeepSpeed with compiled ops kept out, and join the gloo process group; returns deepspeed.

    The shm all-reduce would JIT-build a C++ op (25-130 s); it must be marked incompatible before
    the communication backend is created.
    """
    import deepspeed

    from mist_ds.runtime import join_process_group

    join_process_group()
    return deepspeed


def close_cpu_distributed() -> None:
    """Leave the process group (ZeRO-3 with offload aborts at exit otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_cases_on_cpu_ranks(run_case, cases: list) -> list:
    """[run_case(case) for each case] inside the gloo process group, which is left however it ends: the body
    of a worker that runs several engines one after another."""
    init_cpu_distributed()
    try:
        results = []
        for case in cases:
            results.append(run_case(case))
            gc.collect()  # the case's engine (reference cycles) goes before the next one is built
        return results
    finally:
        close_cpu_distributed()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    target, world, tmp_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.start_processes(_rank_main, args=(target, world, tmp_dir), nprocs=world, join=True, start_method="spawn")
