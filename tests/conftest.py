"""Shared fixtures: Hydra isolation and the guard against JIT builds of DeepSpeed ops."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "mist_ds" / "conf"


def zoo(group: str) -> list[str]:
    """Selectable options of a config group (the `base_*` files are schemas, not choices)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("base_"))


@pytest.fixture(autouse=True)
def _isolated_hydra():
    """No test sees GlobalHydra state another test left behind."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session", autouse=True)
def _no_jit_builds():
    """A missed JIT build of a DeepSpeed op costs minutes in CI: fail loudly if one happened."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    before = set(os.listdir(ext)) if ext and os.path.isdir(ext) else set()
    yield
    after = set(os.listdir(ext)) if ext and os.path.isdir(ext) else set()
    assert after == before, f"something was JIT-compiled into TORCH_EXTENSIONS_DIR: {sorted(after - before)}"
