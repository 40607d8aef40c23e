"""One GPU in five minutes: trace the model's layers under this machine's torch, profile this machine quickly, tune a
1.3B model for its one GPU, train each plan 20 steps under `mist-ds measure` on executor `deepspeed` and on executor
`mist`, and write predicted beside measured (step time, peak memory, model states, FLOPs, collective bytes counted in
the engine) into one results file (docs/design.md, The GPU check).

On a lent GPU machine (the device tool runs it in the repository's root; benchmarks/gpu/wheels.sh, run here first,
puts the packages the machine lacks and this checkout's commit into .whl/, which the run carries):
    bash benchmarks/gpu/check.sh      # writes $OUT/gpu_check.md, $OUT/gpu_check.tgz (the steps' files and logs)
On this machine, the same flow on CPU ranks (the test runs it so, with --steps 2):
    python -m benchmarks.gpu_check --cluster cpu --model tiny --no-profile --out /tmp/gpu_check

Every step is a `mist-ds` command in its own process with its own time limit, cut to what is left of --deadline-s
(the device tool kills a command at its own limit, and with it whatever was not written yet); a step that fails is
recorded with its log's last lines and the flow goes on where it can (a failed profile: the zoo's datasheet cluster
is tuned instead), and after every step the results file is written again and the steps' files packed into one
archive beside it (--results: the device tool returns at most 8 files from $OUT), so one call of a scarce machine
says as much as it can even when it is cut short.
"""
from __future__ import annotations

import argparse
import json
import io
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import load_average, results_header, source_tree, table_text
from mist_ds.files import write_atomic

GPU_CLUSTERS: tuple[tuple[str, int, str], ...] = (
    ("H200", 0, "h200-141g"), ("H100", 0, "h100-80g"), ("A100", 60_000, "a100-80g"), ("A100", 0, "a100-40g"),
    ("L4", 0, "l4-24g"))
"""(a word of nvidia-smi's GPU name, at least this many MiB of memory, the zoo's cluster): the first row that matches
names the cluster whose datasheet the check starts from."""
EXECUTORS: tuple[str, ...] = ("deepspeed", "mist")
PROFILED_CLUSTER = "gpu-check"
GIB = 2**30
LEAST_STEP_S = 20.0
"""A step with less than this left before the deadline is skipped (no step does anything useful in less)."""
INTERRUPT_GRACE_S = 15.0
"""Seconds a step has, once interrupted at its limit, to stop its ranks (observe.ranks.run_in_session kills their
session on an interrupt) before its process group is killed."""
PACKED_FILE_MAX_BYTES = 4 * 2**20
PACKED_MAX_BYTES = 12 * 2**20
"""Files larger than the first, and files past the second in all, stay out of the archive (the device tool returns
at most 16 MiB a file; the archive's compression only shrinks them)."""


def cluster_for_gpu(name: str, memory_mib: int) -> str:
    """The zoo's cluster for a GPU as nvidia-smi names it ('NVIDIA H100 80GB HBM3', 81559): GPU_CLUSTERS' first
    match; SystemExit naming the GPU and the fix where none does."""
    for word, least_mib, cluster in GPU_CLUSTERS:
        if word in name.split() or any(part.startswith(word + "-") for part in name.split()):
            if memory_mib >= least_mib:
                return cluster
    raise SystemExit(f"gpu_check: no zoo cluster for the GPU {name!r} ({memory_mib} MiB); name one with --cluster "
                     f"(one of {', '.join(sorted({c for _, _, c in GPU_CLUSTERS}))}, or cpu)")


def gpu_of_this_machine() -> tuple[str, int] | None:
    """(name, memory in MiB) of GPU 0 as nvidia-smi reports them; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    name, memory = out.splitlines()[0].rsplit(",", 1)
    return name.strip(), int(float(memory))


@dataclass(frozen=True)
class Step:
    """One `mist-ds` command of the flow: its name (the log's), its arguments, its time limit in seconds."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True)
class Outcome:
    step: Step
    returncode: int | None
    """None: stopped at its time limit, or skipped (`skipped`)."""
    seconds: float
    tail: str
    """The log's last lines (what failed says why)."""
    skipped: bool = False
    """Not started: too little was left before the deadline."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def status(self) -> str:
        if self.skipped:
            return "skipped: no time left"
        return "stopped at its limit" if self.returncode is None else str(self.returncode)


def _interruptible() -> None:
    """In the step's process before it runs: SIGINT back to its default, which Python turns into KeyboardInterrupt (a
    check started as a background job inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_command(cmd: list[str], log: Path, timeout_s: float) -> int | None:
    """`cmd`'s exit code, its output in `log`; None where it ran past `timeout_s`: then it is interrupted (SIGINT to
    its process group, so mist-ds stops its ranks' own session) and killed if still running INTERRUPT_GRACE_S
    later (_stop)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_interruptible)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return None
        except BaseException:  # the check itself interrupted: the step stops its ranks as at its limit
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the step's process group (the session leader's pid is its id), SIGKILL if it still runs
    INTERRUPT_GRACE_S later: mist-ds kills its ranks' own session on the interrupt; a step that ignores it for that
    long loses only its own group (its ranks' session is then left to its own launch limit)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_step(step: Step, logs: Path, deadline: float | None = None) -> Outcome:
    """Run `mist-ds <argv>` (this Python, `-m mist_ds.cli.main`) with its log in `logs/<name>.log`, for at most its
    time limit or what is left before `deadline` (time.monotonic()); skipped where under LEAST_STEP_S is left."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{step.name}.log"
    limit = step.timeout_s if deadline is None else min(step.timeout_s, deadline - time.monotonic())
    if limit < LEAST_STEP_S:
        outcome = Outcome(step, None, 0.0, f"{max(limit, 0.0):.0f} s were left before the deadline", skipped=True)
    else:
        start = time.monotonic()
        code = run_command([sys.executable, "-m", "mist_ds.cli.main", *step.argv], log, limit)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        outcome = Outcome(step, code, time.monotonic() - start, tail)
    print(f"gpu_check: {step.name}: {outcome.status} ({outcome.seconds:.1f} s)", flush=True)
    return outcome


@dataclass(frozen=True)
class Settings:
    cluster: str
    model: str
    global_batch_size: int
    warmup: int
    steps: int
    profile: bool
    out: Path
    """The steps' folder (their run folders and logs)."""
    results: Path | None = None
    """Where gpu_check.md and the archive of `out` go (the device tool's $OUT); None: `out` itself, no archive."""
    deadline: float | None = None
    """time.monotonic() by which the last step must end; None: each step's own limit alone."""


def analyze_step(s: Settings) -> Step:
    """`mist-ds analyze`: the model's layers traced under this machine's torch (cached for the steps after it), their
    expressions in the log; a torch that fixes the traced sizes fails it (FixedSizeError) before any plan is priced."""
    return Step("analyze", ("analyze", f"model={s.model}", f"cluster={s.cluster}",
                            f"hydra.run.dir={s.out / 'analyze'}"), 90.0)


def profile_step(s: Settings) -> Step:
    return Step("profile", ("profile", f"model={s.model}", f"cluster={s.cluster}", "cluster.gpus_per_node=1",
                            f"train.global_batch_size={s.global_batch_size}", "profile.quick=true",
                            f"profile.name={PROFILED_CLUSTER}", f"profile.out_dir={s.out / 'profile'}",
                            "tuner.quiet=true", f"hydra.run.dir={s.out / 'profile'}"), 180.0)


def executor_steps(s: Settings, config_dir: tuple[str, ...], cluster: str, executor: str) -> tuple[Step, Step]:
    """Tune for `executor`, then measure its plan (its overrides name the cluster, found in the same config dir)."""
    tuned = s.out / f"tune-{executor}"
    tune = Step(f"tune-{executor}", ("tune", *config_dir, f"cluster={cluster}", f"model={s.model}",
                                     "cluster.gpus_per_node=1", "cluster.nodes=1",
                                     f"train.global_batch_size={s.global_batch_size}", f"tuner.runtime={executor}",
                                     "tuner.compare_baselines=false",
                                     "tuner.quiet=true", f"hydra.run.dir={tuned}"), 120.0)
    measure = Step(f"measure-{executor}", ("measure", *config_dir, f"plan={tuned / 'plan.json'}",
                                           f"measure.num_warmup_steps={s.warmup}", f"measure.num_steps={s.steps}",
                                           f"hydra.run.dir={s.out / f'measure-{executor}'}"), 240.0)
    return tune, measure


def run_flow(s: Settings, after_step: Callable[[list[Outcome]], None] = lambda outcomes: None) -> list[Outcome]:
    """Analyze the model's layers, profile (unless told not to), then tune and measure on each executor; every
    outcome, in order, each also handed to `after_step` with those before it as it ends."""
    outcomes, logs = [], s.out / "logs"

    def run(step: Step) -> bool:
        outcomes.append(run_step(step, logs, s.deadline))
        after_step(list(outcomes))
        return outcomes[-1].ok

    config_dir: tuple[str, ...] = ()
    cluster = s.cluster
    if not run(analyze_step(s)):  # no plan is priced right without the layers' trace: the device's time is scarce
        return outcomes
    if s.profile and run(profile_step(s)):
        config_dir, cluster = ("-cd", str(s.out / "profile")), PROFILED_CLUSTER
    for executor in EXECUTORS:
        tune, measure = executor_steps(s, config_dir, cluster, executor)
        if run(tune):
            run(measure)
    return outcomes


def measured_rows(out: Path) -> list[list]:
    """One row per executor measured (measured_row); a measure.json this cannot read gets a row saying why (the
    archive keeps the file)."""
    rows = []
    for executor in EXECUTORS:
        path = out / f"measure-{executor}" / "measure.json"
        if not path.is_file():
            continue
        try:
            rows.append(measured_row(executor, json.loads(path.read_text())))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
            rows.append([executor, f"measure.json unreadable here ({type(error).__name__}: {error})"] + [""] * 7)
    return rows


def measured_row(executor: str, r: dict) -> list:
    """Layout, step time predicted / measured (median) and the error, then rank 0's peak memory and model states
    (GiB: the priced parts, device and host), FLOPs and collective bytes predicted / measured."""
    from mist_ds.specs.strategy import layout_text, strategy_from_dict

    measured = statistics.median(r["measured_iteration_time_s"])
    comm = lambda side: sum((r[f"{side}_comm_bytes"] or [{}])[0].values())  # noqa: E731
    priced_parts = r["predicted_model_state_bytes"][0]  # weights, grads, optimizer, buffers, host
    states = lambda side: sum(r[f"{side}_model_state_bytes"][0][k] for k in priced_parts)  # noqa: E731
    return [executor, layout_text(strategy_from_dict(r["strategy"], "measure.strategy")),
            f"{r['predicted_iteration_time_s'][0]:.4f}", f"{measured:.4f}", f"{r['time_error']:+.1%}",
            f"{r['predicted_peak_memory_bytes'][0] / GIB:.2f} / {r['measured_peak_memory_bytes'][0] / GIB:.2f}",
            f"{states('predicted') / GIB:.3f} / {states('measured') / GIB:.3f}",
            f"{r['predicted_flops'][0]:.4g} / {r['measured_flops'][0]:.4g}",
            f"{comm('predicted'):.4g} / {comm('measured'):.4g}"]


def report(s: Settings, outcomes: list[Outcome], machine: str, command: str, commit: str, load: str) -> str:
    steps = table_text(["step", "exit", "seconds"], [[o.step.name, o.status, f"{o.seconds:.1f}"] for o in outcomes])
    failed = "".join(f"\n\n`{o.step.name}` ended so:\n\n```\n{o.tail}\n```" for o in outcomes if not o.ok)
    rows = measured_rows(s.out)
    measured = table_text(["executor", "plan", "predicted s", "measured s", "error", "peak GiB (pred / meas)",
                           "model states GiB (pred / meas)", "FLOPs (pred / meas)", "collective bytes (pred / meas)"],
                          rows) if rows else "No plan was measured."
    cluster = (f"profiled on this machine ({PROFILED_CLUSTER}, from {s.cluster})"
               if any(o.step.name == "profile" and o.ok for o in outcomes) else f"the zoo's {s.cluster} (datasheet)")
    return "\n".join([
        results_header("GPU check: a plan for one GPU, predicted beside measured", command,
                       "held out: measured on this machine, never fitted to (the profile, where it ran, measured its "
                       "operators, not these steps)", machine=machine, load=load, commit=commit),
        f"Model {s.model}, global batch {s.global_batch_size}, cluster {cluster}, one GPU; {s.warmup} warm-up and "
        f"{s.steps} timed steps per plan (`mist-ds measure`: the median step; rank 0's numbers, counted in the "
        "engine).", "", measured, "", "Steps:", "", steps + failed, ""])


def machine_text(gpu: tuple[str, int] | None) -> str:
    import importlib.metadata

    import torch

    device = f"{gpu[0]} ({gpu[1]} MiB)" if gpu else "no GPU (CPU ranks)"
    return (f"{device}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"DeepSpeed {importlib.metadata.version('deepspeed')}")


def pack(folder: Path, archive: Path) -> None:
    """`folder`'s files (within PACKED_FILE_MAX_BYTES and PACKED_MAX_BYTES) as the gzipped tar `archive`, written
    atomically."""
    data, packed = io.BytesIO(), 0
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            size = path.stat().st_size if path.is_file() else None
            if size is not None and size <= PACKED_FILE_MAX_BYTES and packed + size <= PACKED_MAX_BYTES:
                tar.add(path, arcname=str(path.relative_to(folder.parent)))
                packed += size
    write_atomic(archive, data.getvalue())


def commit_here() -> str:
    """The checkout's commit as MIST_DS_COMMIT names it (check.sh reads it from .whl/commit.txt, written by
    benchmarks/gpu/wheels.sh where git is), else as git says, else that it is unknown."""
    if os.environ.get("MIST_DS_COMMIT"):
        return os.environ["MIST_DS_COMMIT"]
    try:
        tree = source_tree()
    except OSError:  # no git on this machine
        tree = ""
    return tree if tree and not tree.startswith(" ") else "unknown (no git history here and MIST_DS_COMMIT not set)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="the zoo's cluster to start from (default: from nvidia-smi's GPU name)")
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"), help="the steps' folder")
    parser.add_argument("--results", type=Path, help="where gpu_check.md and gpu_check.tgz (the steps' folder "
                        "packed) go, after every step (default: the steps' folder, no archive)")
    parser.add_argument("--deadline-s", type=float, help="seconds from now by which the last step must end")
    args = parser.parse_args(argv)
    start = time.monotonic()
    gpu = gpu_of_this_machine()
    if args.cluster is None and gpu is None:
        raise SystemExit("gpu_check: nvidia-smi found no GPU; name a cluster with --cluster (cpu on CPU ranks)")
    cluster = args.cluster or cluster_for_gpu(*gpu)
    out = args.out.resolve()
    results = args.results.resolve() if args.results and args.results.resolve() != out else None
    s = Settings(cluster, args.model, args.global_batch_size, args.warmup, args.steps, args.profile, out, results,
                 None if args.deadline_s is None else start + args.deadline_s)
    for folder in filter(None, (s.out, s.results)):
        folder.mkdir(parents=True, exist_ok=True)
    load, commit, machine = load_average(), commit_here(), machine_text(gpu)
    command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])

    def publish(outcomes: list[Outcome]) -> str:
        text = report(s, outcomes, machine, command.strip(), commit,
                      f"load average at start {load}, at the end {load_average()} (1, 5, 15 minutes)")
        write_atomic((s.results or s.out) / "gpu_check.md", text)
        if s.results:
            pack(s.out, s.results / "gpu_check.tgz")
        return text

    published: list[str] = []  # every run publishes after its first step (the analyze, at least)
    outcomes = run_flow(s, lambda done: published.append(publish(done)))
    print(published[-1])
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
