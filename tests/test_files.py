"""Atomic writes (mist_ds/files.py): a reader sees the old file or the whole new one; several files are
written all or none; nothing is left behind on failure."""
from __future__ import annotations

import json
import os

import pytest

from mist_ds.files import write_atomic, write_files_atomic, write_json_atomic


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "plan.txt"
    write_atomic(target, "first")
    write_atomic(target, b"second \xe2\x9c\x93")
    assert target.read_bytes() == b"second \xe2\x9c\x93"
    assert os.listdir(tmp_path) == ["plan.txt"]


def test_unserializable_json_leaves_no_file_and_no_temporary(tmp_path):
    target = tmp_path / "ds_config.json"
    with pytest.raises(TypeError):
        write_json_atomic(target, {"bad": object()})
    with pytest.raises(ValueError):
        write_json_atomic(target, {"nan": float("nan")})  # not JSON
    assert os.listdir(tmp_path) == []
    write_json_atomic(target, {"ok": 1})
    with pytest.raises(TypeError):
        write_json_atomic(target, {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": 1}  # the old file is untouched


def test_failed_write_removes_its_temporary(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    write_atomic(target, "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["plan.json"]


def test_write_files_atomic_all_or_none(tmp_path):
    paths = write_files_atomic(tmp_path, {"plan.json": "{}\n", "ds_config.json": b"{}\n"})
    assert [p.name for p in paths] == ["plan.json", "ds_config.json"]
    with pytest.raises(TypeError):  # the second content is bad: the first file is not replaced either
        write_files_atomic(tmp_path, {"plan.json": "new", "ds_config.json": 3})
    (tmp_path / "report").mkdir()
    with pytest.raises(IsADirectoryError):
        write_files_atomic(tmp_path, {"plan.json": "new", "report": "x"})
    with pytest.raises(ValueError, match="plain file name"):
        write_files_atomic(tmp_path, {"plan.json": "new", "../escape": "x"})
    assert (tmp_path / "plan.json").read_text() == "{}\n"
    assert sorted(os.listdir(tmp_path)) == ["ds_config.json", "plan.json", "report"]


def test_write_files_atomic_failure_while_writing_temporaries(tmp_path, monkeypatch):
    write_files_atomic(tmp_path, {"a.json": "old-a", "b.json": "old-b"})
    real_fsync, calls = os.fsync, []

    def fail_second(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fail_second)
    with pytest.raises(OSError):
        write_files_atomic(tmp_path, {"a.json": "new-a", "b.json": "new-b"})
    monkeypatch.undo()
    assert (tmp_path / "a.json").read_text() == "old-a" and (tmp_path / "b.json").read_text() == "old-b"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json"]
