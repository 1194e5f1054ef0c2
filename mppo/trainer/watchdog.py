"""Stall detection: a rank that makes no progress for `trainer.collective_timeout_s` says where it is and exits.

Every phase boundary of the fit loop (entering or leaving weight_sync, gen, update_actor, validate, a checkpoint
save, ...) is a heartbeat. A watcher thread per rank waits for the next one; when the innermost open phase has
run for the whole timeout, the rank writes which phase and step it was in, dumps its Python stacks and exits
with STALL_EXIT_CODE, so the launcher (torchrun, Slurm) ends the run instead of leaving it hanging. A peer that
died or hangs leaves the others blocked inside a collective of the same phase, so every rank reports.

Why a thread and not only torch.distributed's timeout: gloo raises its timeout as an exception somewhere in the
stack (or not at all for a rank that hangs in its own code) and NCCL aborts without saying where the trainer was.
The collectives release the GIL while they wait, so the watcher runs. For code that blocks while holding the
GIL, `faulthandler` (a C thread) is armed a little later as a backstop: it dumps the stacks and exits with 1.
The process group's own timeout is set beyond both (`process_group_timeout_s`).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STALL_EXIT_CODE = 124  # as coreutils `timeout`
GRACE_S = 2.0  # after reporting: lets the peers (whose deadlines fall within this) report too before torchrun
# tears them down on seeing this rank exit


def backstop_delay_s(timeout_s: float) -> float:
    """When faulthandler fires if the watcher thread could not (it holds no GIL)."""
    return timeout_s + GRACE_S + max(5.0, 0.1 * timeout_s)


def process_group_timeout_s(timeout_s: float) -> float:
    """torch.distributed's own timeout: beyond both watchdogs, so a stall is reported rather than raised."""
    return 2 * timeout_s + 60


class StallWatchdog:
    """Armed while a phase is open; every phase entry and exit restarts its clock."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self._open: list[tuple[str, int]] = []  # (phase, step), innermost last
        self._deadline: float | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        self._beat(push=(name, step))
        try:
            yield
        finally:
            self._beat(pop=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        faulthandler.cancel_dump_traceback_later()

    # ------------------------------------------------------------------------------------------------ internals
    def _beat(self, push: tuple[str, int] | None = None, pop: bool = False) -> None:
        with self._cond:
            if push:
                self._open.append(push)
            if pop:
                self._open.pop()
            armed = bool(self._open)
            self._deadline = time.monotonic() + self.timeout_s if armed else None
            if armed and self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="mppo-stall-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        if armed:
            faulthandler.dump_traceback_later(backstop_delay_s(self.timeout_s), exit=True)
        else:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self._report_and_exit()

    def _report_and_exit(self) -> None:
        phase, step = self._open[-1]
        path = " > ".join(name for name, _ in self._open)
        # The leading newline: a peer's faulthandler dump writes its lines in pieces to the same stream, so
        # without it this line could start mid-way through one of them (one write of < PIPE_BUF is atomic).
        message = (f"\nmppo: stall [rank {self.rank}]: no progress for {self.timeout_s:g} s in phase '{phase}' of "
                   f"step {step} (open phases: {path}); trainer.collective_timeout_s={self.timeout_s:g}. A peer rank "
                   f"probably died or hangs (see its log). Exiting with code {STALL_EXIT_CODE}; this rank's "
                   "stacks follow.\n")
        os.write(2, message.encode())  # not logging: the stuck main thread may hold a handler's lock
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        time.sleep(GRACE_S)
        os._exit(STALL_EXIT_CODE)
