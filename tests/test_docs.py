"""The documents name only repository paths that exist, and the README stays an entry point.

A path is a backticked or linked token with a '/' whose first component is a top-level entry the
repository ships (so `mist_ds/cost/stage.py`, `benchmarks/results/`, `conf/` are checked; DeepSpeed's
own `deepspeed/runtime/...`, a user's `my_conf/model/x.yaml`, Hydra's `outputs/...` or a token with a
<placeholder> are not), with any `:line` or `#anchor` suffix removed.
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "results" / "README.md"]
README_MAX_LINES = 200
_CODE = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
RUN_OUTPUTS = {"outputs", "multirun"}  # what Hydra runs write at the top of a checkout (.gitignore)
TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - RUN_OUTPUTS


def named_paths(text: str) -> set[str]:
    found = set()
    for token in _CODE.findall(text) + _LINK.findall(text):
        token = re.split(r"[:#]", token, maxsplit=1)[0].rstrip(".,;")
        if "/" in token and "<" not in token and not token.startswith(("http", "pkg://", "/")) \
                and token.split("/")[0] in TOP_LEVEL:
            found.add(token)
    return found


def test_the_path_finder_checks_repository_paths_only():
    text = "`mist_ds/cost/stage.py:12` [x](docs/design.md#tuner) `deepspeed/runtime/engine.py:3` `my_conf/m.yaml`"
    assert named_paths(text) == {"mist_ds/cost/stage.py", "docs/design.md"}


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d.exists()], ids=lambda d: str(d.relative_to(REPO)))
def test_every_named_path_exists(document):
    missing = sorted(p for p in named_paths(document.read_text()) if not (REPO / p).exists())
    assert not missing, f"{document.relative_to(REPO)} names paths that do not exist: {missing}"


def test_readme_is_an_entry_point():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"
    for document in ("docs/design.md", "docs/config.md", "benchmarks/results/README.md"):
        assert (REPO / document).exists(), document


def test_nothing_cites_the_brief_outside_the_repository():
    """Code, tests and docs cite docs/design.md, which ships with the project."""
    offenders = [str(p.relative_to(REPO)) for folder in ("mist_ds", "tests", "benchmarks", "docs", "launch")
                 for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml")
                 and re.search(r"(?<![\w/])DESIGN\.md", p.read_text())]
    offenders += ["README.md"] if re.search(r"(?<![\w/])DESIGN\.md", (REPO / "README.md").read_text()) else []
    assert not offenders, offenders
