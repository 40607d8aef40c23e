"""Ending a user's script together: at its exit (atexit) or the verify phase's end, every rank waits for the others,
the engine lets go of its collectives, then the process group goes, while every thread is still alive.

Left to the interpreter's exit, the engine and its gloo groups are torn down in any order, and a rank whose group
goes while a peer still talks to it aborts ("terminate called without an active exception": seen once in a pipeline
run of the tests' user script). launch/train.py ends the same way (barrier, close, gc, destroy)."""
from __future__ import annotations

import gc
import logging
import sys
from typing import Callable

log = logging.getLogger(__name__)


class Teardown:
    """Called once (a second call does nothing): barrier, `close` (the engine's own teardown), gc, then the process
    group destroyed; nothing where the script already destroyed the group itself, and nothing when the script is
    dying of an exception: its peers may be inside a collective it will never join, a barrier would hold it until
    the process group's timeout, and DeepSpeed's launcher ends them all once this rank exits non-zero."""

    def __init__(self, close: Callable[[], None]) -> None:
        self.close = close
        self.done = False
        self.failed = False
        previous = sys.excepthook

        def note_failure(*info) -> None:
            self.failed = True
            previous(*info)

        sys.excepthook = note_failure

    def __call__(self) -> None:
        from deepspeed import comm as dist

        if self.done or self.failed or not dist.is_initialized():
            self.done = True
            return
        self.done = True
        try:
            dist.barrier()
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 (the script may have destroyed the engine already)
                log.debug("engine teardown at exit: %s", error)
            self.close = lambda: None  # the engine may go now
            gc.collect()
        finally:
            dist.destroy_process_group()
