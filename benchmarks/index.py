"""The index of benchmarks/results/: one row per results file, read from the files' headers.

    .venv/bin/python -m benchmarks.index > benchmarks/results/index.md
    .venv/bin/python -m benchmarks.index --readme    # rewrites README.md's results table from the same headlines

Each row: the file, the script that writes it, what it measures (the file's title), the commit its numbers come
from, how many commits old that is now, whether its data is fitted, validation or held out (or none), and its
headline numbers, quoted from the file by HEADLINES. A headline that no longer matches its file stops the run:
the index never quotes a number the file does not hold.
"""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import HEADER_FIELDS, REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"
NOT_RESULTS = {"README.md", "index.md"}
COMMAND = ".venv/bin/python -m benchmarks.index > benchmarks/results/index.md"
PERCENT = r"([\d.]+%)"
# nccl_rails.md: a node count's row of the NCCL tuning model's first error table (the rows' release, 2.8.4), its
# all-sizes cell.
NCCL_MODEL_ROW = r"Error of NCCL's tuning model[\s\S]*?^\| {} \| \d+ \|(?:[^|]*\|){{3}} " + PERCENT
# closed_loop_cpu.md, and the same loop beside a synthetic load
CLOSED_LOOP_HEADLINES = (("median |error| profiled",
                          r"\| profiled \(`mist-ds profile`, quick\), this run \| " + PERCENT),
                         ("zoo cpu", r"\| zoo `cpu` \(cpu_constants\.md constants\), this run \| " + PERCENT))
# file -> (label, pattern with one group) per headline number, in the order the index quotes them
HEADLINES: dict[str, tuple[tuple[str, str], ...]] = {
    "calibration_a100.md": (("RMS log error on the fit rows", r"RMS \(weighted\) log error on the fit rows: start "
                                                              r"[\d.]+, fitted ([\d.]+)"),),
    "closed_loop_cpu.md": CLOSED_LOOP_HEADLINES,
    "closed_loop_cpu_loaded.md": CLOSED_LOOP_HEADLINES,
    "cost_speed.md": (("10^6 candidates, deepspeed, median s", r"runtime deepspeed: time \+ memory \| ([\d.]+)"),
                      ("mist-paper", r"runtime mist-paper: time \+ memory \| ([\d.]+)")),
    "cpu_constants.md": (("peak fp32 TFLOP/s", r"\| peak_tflops\.fp32 \| ([\d.]+)"),
                         ("bf16", r"\| peak_tflops\.bf16 \| ([\d.]+)")),
    "hf_verify_cpu.md": (("median |error| profiled", r"\| profiled \(`mist-ds profile`, quick\) \| " + PERCENT),
                         ("zoo cpu", r"\| zoo `cpu` \(committed constants\) \| " + PERCENT)),
    "hf_tune.md": (("cold s", r"\| hf, cold cache \| ([\d.]+)"), ("warm s", r"\| hf, warm cache \| ([\d.]+)"),
                   ("zoo warm s", r"\| zoo llama3-8b, warm cache \| ([\d.]+)")),
    "interference_fit.md": (("held-out mean |error|, table", r"held-out mean \|error\| of the elapsed time "
                                                             + PERCENT),
                            ("best scalar", PERCENT + r" with the best single scalar")),
    "measure_cpu.md": (("median |error|", r"\*\*Gate: median \|error\| " + PERCENT),
                       ("Spearman", r"\*\*Gate: median \|error\| [\d.]+% \(<= \d+%\), Spearman ([\d.]+)")),
    "megatron_sc21.md": (("MAPE", r"^MAPE all rows: " + PERCENT), ("max |error|", r"^MAPE all rows: [\d.]+%; max "
                                                                                   r"\|error\| " + PERCENT)),
    "mist_l4.md": (("time MAPE", r"^Time MAPE " + PERCENT), ("peak memory mean |error|", r"peak memory mean "
                                                                                         r"\|error\| " + PERCENT)),
    "mist_runtime.md": (("pp2-dp2-bf16 predicted speedup", r"^\| pp2-dp2-bf16 \|(?:[^|]*\|){5} ([\d.]+)"),
                        ("measured", r"^\| pp2-dp2-bf16 \|(?:[^|]*\|){6} ([\d.]+)")),
    "mist_runtime_paper.md": (("geomean speedup of mist over deepspeed", r"^Geometric mean speedup over the \d+ "
                                                                         r"cases where both fit: ([\d.]+x)"),),
    "long_context.md": (("8 H100 64k: sp plan over best without sp", r"^- 8x H100-80GB, 64k tokens: ([\d.]+x)"),
                        ("its sp", r"^\| 8x H100-80GB \| 64k \| sp searched \| .*?\| sp (\d+),")),
    "model_states.md": (("cells", r"^(\d+) \(case, rank, field\) cells"), ("exact", r"cells: (\d+) exact"),
                        ("beyond the stated residual", r"(\d+) beyond it")),
    "nccl_rails.md": (("NCCL's tuning model (2.8.4 constants), all sizes, median |error|, 4 nodes",
                       NCCL_MODEL_ROW.format(4)),
                      ("8 nodes", NCCL_MODEL_ROW.format(8)), ("16 nodes", NCCL_MODEL_ROW.format(16))),
    "offload_grid.md": (("mist grid, mist-paper, faster than default", r"^\| mist-paper \| mist \| per-gpu \| \d+ "
                                                                       r"\| ([^|]+?) \|"),),
    "partition_solvers.md": (("22b dp objective s", r"^- 22b / deepspeed: .*dp objective ([\d.]+) s"),
                             ("milp", r"^- 22b / deepspeed: .*milp ([\d.]+) s")),
    "plan_quality.md": (("mist-paper on l4 over megatron", r"^\| mist-paper \| l4-24g \| megatron \| \d+ \| "
                                                           r"([\d.]+x)"),
                        ("over aceso", r"^\| mist-paper \| l4-24g \| aceso \| \d+ \| ([\d.]+x)")),
    "predict_many.md": (("predict_many call 2 s", r"^\| predict_many, call 2 \| \d+ \| ([\d.]+)"),
                        ("one by one s", r"^\| predict one by one \| \d+ \| ([\d.]+)"),
                        ("bit-identical rows", r"Bit-identical \(the JSON of every Prediction\): (\d+ of \d+)")),
    "sc21_tune.md": (("recovered, SC'21 features", r"^Summary, SC'21 features: \d+ rows; recovered (\d+)"),
                     ("within 3%", r"^Summary, SC'21 features: .*within 3% (\d+)")),
    "soak.md": (("launches", r"^\*\*(\d+) launches"), ("crashes", r"(\d+) crashes"), ("hangs", r"(\d+) hangs"),
                ("census mismatches", r"(\d+) census mismatches\.\*\*")),
    "soak_script.md": (("launches", r"^\*\*(\d+) launches"), ("crashes", r"(\d+) crashes"),
                       ("census mismatches", r"(\d+) census mismatches"),
                       ("changed losses", r"(\d+) launches with changed losses")),
    "sweep_pictures.md": (("sweep", r"^## Sweep: (\d+ jobs, status \d+)"),),
    "torchtitan_h100.md": (("FSDP 8B TPS/GPU MAPE", r"^MAPE of TPS/GPU over the \d+ rows: " + PERCENT),
                           ("70B on 768 H100, tuned plan's MFU", r"^\| tp .*? \| [\d.]+ \| " + PERCENT)),
    "symbolic_trace.md": (("worst cold s", r"Worst cold ([\d.]+) s"), ("worst cached s", r"worst cached ([\d.]+) s")),
    "tune_speed.md": (("1t search s, deepspeed", r"^\| 1t \| deepspeed \| [\d.]+ \| ([\d.]+)"),
                      ("mist-paper", r"^\| 1t \| mist-paper \| [\d.]+ \| ([\d.]+)")),
    "vtrain.md": (("8-GPU rows, out of the fit: MAPE", r"^- held-out rows \(\d+\): MAPE " + PERCENT),
                  ("Spearman", r"^- held-out rows .*?mean Spearman ([\d.]+)"),
                  ("top-1 regret", r"^- held-out rows .*?mean top-1 regret " + PERCENT)),
    "zero3_cpu.md": (("zero3_fetch_us, bf16", r"^\| bf16 \| [\d.]+ \| ([\d.]+) \|"),
                     ("zero3_hook_us", r"^\| bf16 \| ([\d.]+) \|")),
    "zero_bubble_cpu.md": (("idle zb-h1 / 1F1B, measured", r"^- Idle time .*?zb-h1 / 1F1B: measured ([\d.]+)"),
                           ("simulated", r"^- Idle time .*?, simulated ([\d.]+)\.$")),
    "zero_bubble.md": (("own precision, pipelines: searched plan over 1F1B (geomean)",
                        r"^- At the cases' own precision: .*?over the 1F1B plan on those \d+: ([\d.]+x|none)"),
                       ("zb-h1 picked on", r"^- At the cases' own precision: .*? picks zb-h1 on (\d+ of them)"),
                       ("fp32", r"^- At fp32: .*?over the 1F1B plan on those \d+: ([\d.]+x|none)"),
                       ("bf16", r"^- At bf16: .*?over the 1F1B plan on those \d+: ([\d.]+x|none)")),
}


README = REPO_ROOT / "README.md"
README_BEGIN = "<!-- results table: written by `python -m benchmarks.index --readme` from the results files -->"
README_END = "<!-- end of the results table -->"
README_FILES = ("vtrain.md", "megatron_sc21.md", "nccl_rails.md", "mist_l4.md", "model_states.md", "measure_cpu.md",
                "interference_fit.md", "mist_runtime.md", "cost_speed.md", "tune_speed.md",
                "plan_quality.md", "sc21_tune.md", "hf_tune.md", "soak.md", "soak_script.md")
"""The README's rows: the accuracy files and the speeds a user asks about first; the index lists every file."""


@dataclass(frozen=True)
class Entry:
    file: str
    title: str
    fields: dict[str, str]

    @property
    def script(self) -> str:
        found = re.search(r"-m (benchmarks\.\w+)", self.fields["Command"])
        return found.group(1) if found else "-"

    @property
    def commit(self) -> str:
        """The commit the numbers come from: the recorded one, else the one that last wrote the file."""
        return re.search(r"\b[0-9a-f]{7,40}\b", self.fields["Commit"]).group(0)

    @property
    def data_kind(self) -> str:
        return self.fields["Data"].split(":", 1)[0]


def header_fields(text: str) -> dict[str, str]:
    """The HEADER_FIELDS of a results file, from the lines between its title and the first blank line after
    them ('Field: value', a Markdown line break's two trailing spaces dropped)."""
    fields = {}
    for line in text.splitlines()[1:]:
        name, _, value = line.partition(": ")
        if name in HEADER_FIELDS and name not in fields:
            fields[name] = value.rstrip()
        elif fields and not line.strip():
            break
    return fields


def read_entry(path: Path) -> Entry:
    text = path.read_text()
    fields = header_fields(text)
    missing = [name for name in HEADER_FIELDS if name not in fields]
    if missing or not text.startswith("# "):
        raise ValueError(f"{path.name}: no title or header fields {missing}")
    return Entry(path.name, text.splitlines()[0][2:], fields)


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p.name not in NOT_RESULTS)


def headline(path: Path) -> str:
    """The headline numbers HEADLINES names, quoted from the file; raises where one no longer matches."""
    text = path.read_text()
    quoted = []
    for label, pattern in HEADLINES[path.name]:
        found = re.search(pattern, text, re.MULTILINE)
        if not found:
            raise ValueError(f"{path.name}: headline {label!r} ({pattern}) not found")
        quoted.append(f"{label} {found.group(1).strip()}")
    return "; ".join(quoted)


def commits_since(commit: str) -> int:
    done = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def index_lines() -> list[str]:
    lines = ["# Index of the benchmark results", "",
             f"Written by `{COMMAND}` at commit {head()}: each row read from its file's header (benchmarks/common.py "
             "`results_header`); age: commits from the file's commit to that one (*not recorded; last write*: the run "
             "recorded none, so the commit that last wrote the file); *dirty*: the run's tree had uncommitted "
             "changes. Data: *fitted*, numbers fitted on "
             "these rows; *validation*, reference rows read while the model changed; *held out*, rows no fit or "
             "change looked at; *none*, no reference data (speed, stability, plans). What each file means and how "
             "far to trust it: [README.md](README.md).", "",
             "| file | script | what it measures | commit | age | data | headline |",
             "|---|---|---|---|---|---|---|"]
    for path in results_files():
        entry = read_entry(path)
        dirty = " (dirty)" if "dirty" in entry.fields["Commit"] else ""
        recorded = "" if "not recorded" not in entry.fields["Commit"] else " (not recorded; last write)"
        lines.append(f"| [{entry.file}]({entry.file}) | `{entry.script}` | {entry.title.replace('|', chr(92) + '|')} | "
                     f"{entry.commit}{dirty}{recorded} | {commits_since(entry.commit)} | {entry.data_kind} | "
                     f"{headline(path).replace('|', chr(92) + '|')} |")
    return lines


def readme_table() -> list[str]:
    """README.md's results table: README_FILES' titles, data kinds and headlines, as the index quotes them."""
    lines = ["| what it measures | data | headline | file |", "|---|---|---|---|"]
    for name in README_FILES:
        path = RESULTS / name
        entry = read_entry(path)
        lines.append(f"| {entry.title.replace('|', chr(92) + '|')} | {entry.data_kind} | "
                     f"{headline(path).replace('|', chr(92) + '|')} | `benchmarks/results/{name}` |")
    return lines


def with_readme_table(readme: str) -> str:
    """`readme` with the lines between README_BEGIN and README_END replaced by readme_table()."""
    before, rest = readme.split(README_BEGIN + "\n", 1)
    _, after = rest.split(README_END, 1)
    return before + README_BEGIN + "\n" + "\n".join(readme_table()) + "\n" + README_END + after


def main() -> None:
    if sys.argv[1:] == ["--readme"]:
        README.write_text(with_readme_table(README.read_text()))
    else:
        print("\n".join(index_lines()))


if __name__ == "__main__":
    main()
