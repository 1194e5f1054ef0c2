"""Launching the real `mppo train` CLI for the reliability tests, and reading what a run left behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from dist_util import REPO, free_port, launch
from e2e_assets import make_assets

# Keys that measure the machine, not the computation: they may differ between a resumed and a straight run.
TIMING_PREFIXES = ("timing_s/", "perf/")


@dataclass
class Launch:
    returncode: int
    output: str  # stdout and stderr together, in order
    seconds: float
    marks: dict[str, float]  # first line containing each `mark` → seconds since the start
    exit_codes: list[int] | None = None  # a forked launch's ranks' exit codes (torchrun prints its own)

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]

    def child_exit_codes(self) -> list[int]:
        """What torchrun reports for its workers ('exitcode  : 2 (pid: ...)'); a forked launch's own."""
        if self.exit_codes is not None:
            return self.exit_codes
        return [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", self.output)]


def train(overrides: list[str], *, world: int | None = 2, env: dict[str, str] | None = None,
          timeout: float = 240, marks: tuple[str, ...] = (), log: Path | None = None, forked: bool = False) -> Launch:
    """`torchrun --nproc_per_node=world -m mppo train configs/demo_cpu.yaml ...`; world=None: plain `python -m mppo`.
    `log`: where to keep the output (for a failing test's reader).

    Fails if any process of the launch outlives it (an orphan would also hold the output pipe open).
    forked=True: the ranks are forked with their imports done (tests/dist_util.launch, ~15 s of CPU less per rank),
    for the launches of a chain whose subject is the run, not torchrun; their output is every rank's stdout, then
    every rank's stderr, `marks` are not timed, and no process is looked for afterwards (the launcher joins its
    ranks).
    """
    if forked:
        return _train_forked(overrides, world or 1, env, timeout, log)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}"] if world else [sys.executable]
    cmd = [*launcher, "-m", "mppo", "train", "configs/demo_cpu.yaml", *overrides]
    launch_id = uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if k != "MPPO_FAULT"}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), LAUNCH_ID: launch_id, **(env or {})})
    start = time.monotonic()
    seen: dict[str, float] = {}
    chunks: list[str] = []
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def read() -> None:
        for line in proc.stdout:
            chunks.append(line)
            for mark in marks:
                if mark in line and mark not in seen:
                    seen[mark] = time.monotonic() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(launch_id)
        raise AssertionError(f"launch ran past {timeout} s:\n{''.join(chunks)[-6000:]}") from None
    reader.join(timeout=10)
    if log is not None:
        log.write_text("".join(chunks))
    leftovers = _processes(launch_id)
    if leftovers:
        time.sleep(3)  # give dying processes a moment
        leftovers = _processes(launch_id)
    _kill(launch_id)
    assert not leftovers, f"processes outlived the launch: {leftovers}\n{''.join(chunks)[-3000:]}"
    return Launch(returncode, "".join(chunks), time.monotonic() - start, seen)


def _train_forked(overrides: list[str], world: int, env: dict[str, str] | None, timeout: float,
                  log: Path | None) -> Launch:
    start = time.monotonic()
    # os.environ's MPPO_FAULT, if any, is the launching test's, not this launch's
    proc = launch(world, ["-m", "mppo", "train", "configs/demo_cpu.yaml", *overrides],
                  env={"MPPO_FAULT": "", **(env or {})}, timeout=timeout)
    output = proc.stdout + proc.stderr
    if log is not None:
        log.write_text(output)
    return Launch(proc.returncode, output, time.monotonic() - start, {}, proc.exit_codes)


LAUNCH_ID = "MPPO_TEST_LAUNCH_ID"


def _processes(launch_id: str) -> dict[int, str]:
    """pid → command line of every live process started by this launch (found by its environment marker)."""
    found = {}
    marker = f"{LAUNCH_ID}={launch_id}".encode()
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            if marker in (proc_dir / "environ").read_bytes().split(b"\0"):
                found[int(proc_dir.name)] = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _kill(launch_id: str) -> None:
    for pid in _processes(launch_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return merged


def computed(row: dict) -> dict:
    """A metrics row without its timing/perf keys."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def mppo_traceback(output: str) -> bool:
    """True when an exception escaped `mppo train` (its traceback runs through mppo/cli.py). Neither torchrun's own
    report nor a traceback mppo logs on purpose (a failing reward function's) counts."""
    return f'File "{REPO}/mppo/cli.py"' in output


def session_assets(tmp_path_factory) -> Path:
    """The tiny model and data, made once per test session (read-only for the tests that share it)."""
    root = tmp_path_factory.getbasetemp() / "reliability_assets"
    if not (root / "model" / "config.json").is_file():
        make_assets(root)
    return root
