"""Atomic file writes: a reader sees the old file or the whole new one, never a half-written one.

The one writer of mist_ds's output files (plan files, reports) and cache entries; it imports nothing
of mist_ds, so every layer may use it.

Each write goes to a temporary file in the target's own folder (so the final `os.replace` is a rename
within one file system, which POSIX makes atomic), is flushed and fsync'ed, then renamed over the target;
the folder is fsync'ed after the rename so the new name survives a crash too. On any exception the
temporary file is deleted and the target is left as it was.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Union

Content = Union[str, bytes]
TEMP_SUFFIX = ".tmp"


def _as_bytes(content: Content) -> bytes:
    """UTF-8 for text; bytes pass through. Anything else is a caller's bug, refused before any write."""
    if isinstance(content, bytes):
        return content
    if isinstance(content, str):
        return content.encode("utf-8")
    raise TypeError(f"file content must be str or bytes, not {type(content).__name__}")


def _temp_path(target: Path) -> Path:
    """A hidden, unique sibling of `target`: same folder, so the rename never crosses file systems."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _fsync_dir(directory: Path) -> None:
    """Persist a rename in `directory`; platforms that cannot open a folder (Windows) skip it."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(target: Path, data: bytes) -> Path:
    """Write `data` to a new temporary sibling of `target`, fsync'ed; delete it again on failure."""
    temp = _temp_path(target)
    # O_EXCL: never write through someone else's file; mode 0o666 lets the umask decide, like open().
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _discard(temp)
        raise
    return temp


def _discard(temp: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)


def write_atomic(path: str | os.PathLike, content: Content) -> Path:
    """Replace `path` with `content` (str as UTF-8, or bytes) atomically; return the path.

    The folder must exist. On failure the old file, if any, is untouched and no temporary remains.
    """
    target = Path(path)
    data = _as_bytes(content)
    temp = _write_temp(target, data)
    try:
        os.replace(temp, target)
    except BaseException:
        _discard(temp)
        raise
    _fsync_dir(target.parent)
    return target


def json_text(obj: Any) -> str:
    """Strict JSON (NaN and infinities refused: JSON has none), 2-space indent, trailing newline."""
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Serialize `obj` first (a value JSON cannot hold raises before anything touches the disk), then
    write it with `write_atomic`."""
    return write_atomic(path, json_text(obj))


def _targets(directory: Path, files: Mapping[str, Content]) -> dict[Path, bytes]:
    """Check every name and content before the first byte is written."""
    targets: dict[Path, bytes] = {}
    for name, content in files.items():
        if not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{name!r}: give a plain file name inside {directory}, not a path")
        target = directory / name
        if target.is_dir():
            raise IsADirectoryError(f"{target} is a folder: it cannot be replaced by a file")
        targets[target] = _as_bytes(content)
    return targets


def write_files_atomic(directory: str | os.PathLike, files: Mapping[str, Content]) -> list[Path]:
    """Write several files in `directory` (which must exist), all or none as far as a file system allows.

    Every name and content is checked and every temporary file written and fsync'ed before the first
    rename, so a bad value, a full disk or a serialization error leaves none of the files changed. Only
    the final renames remain: they cannot run out of space, and if one still fails (the folder made
    read-only meanwhile) the files renamed before it stay new and the rest stay old. Returns the paths
    in the order given.
    """
    folder = Path(directory)
    targets = _targets(folder, files)
    temps: dict[Path, Path] = {}
    try:
        for target, data in targets.items():
            temps[target] = _write_temp(target, data)
        for target, temp in temps.items():
            os.replace(temp, target)
    except BaseException:
        for temp in temps.values():
            _discard(temp)
        raise
    _fsync_dir(folder)
    return list(targets)
