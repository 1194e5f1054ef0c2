"""Starting an sglang.Engine so that a failure is one clear error in seconds, not a killed process or a hang.

What SGLang 0.5.23 does on its own: its scheduler process logs the traceback of a start-up failure and sends SIGQUIT
to the parent, whose launch-phase handler kills the parent's whole process tree (the trainer rank included, with no
error of ours and no chance for the other ranks to hear of it). mppo passes its own `custom_sigquit_handler` (a
server argument SGLang supports), which turns the first such signal into an exception in the starting thread (after
a failed start, SIGQUIT stays ignored: the trainer is stopping, and a late signal from another of SGLang's dying
processes would kill it). SGLang's output during start-up (its logs, the child's traceback) goes to a log file
instead of the trainer's stderr; the spawned processes keep writing there afterwards. The error names the failure
(the last exception line of the log, or the parent's own exception) and the log file.

The processes SGLang spawns must not inherit torchrun's environment: with TORCHELASTIC_USE_AGENT_STORE set, the
scheduler's own torch.distributed init (a group of the engine's TP ranks on a tcp:// address of its choosing)
turns into a client of torchrun's agent store and waits forever for a server that is never there. So the launcher's
variables are hidden from them while the engine starts (`LAUNCHER_ENV`), and restored for the trainer afterwards.

A failed start leaves SGLang's ZeroMQ context behind, with sockets to processes that are gone: when the garbage
collector finalizes it (at the next collection, or at exit), zmq_ctx_term waits forever for their messages to be
delivered. The contexts created by a failed start are destroyed at once, with linger 0.

Stopping: SGLang's Engine.shutdown ends by SIGKILLing every child process of the caller (kill_process_tree of
os.getpid()), not only the engine's: in a trainer rank that includes megatron's dist-checkpoint Manager (the next
save fails with BrokenPipeError), data-loader workers and tool processes. `stop_engine` narrows that kill to the
processes the engine started (`StartedEngine.processes`, recorded at start) and their descendants.

Logging: SGLang's Engine configures this process's root logger (`configure_logger`: logging.basicConfig with
force=True at its `log_level`, "error" for mppo), which removed the trainer's console handler and silenced its INFO
lines for the rest of the run. The root logger's handlers and level are put back once the start returns (or
fails), and SGLang's own loggers in this process (its TokenizerManager) write to the engine's log file at that
level instead of the console, next to what its scheduler and detokenizer processes write there.

SGLang also picks its ports with Python's `random`, which mppo seeds alike on every rank: engines starting at once
on one host would pick the same port (EADDRINUSE). The start runs on a fresh `random` state (from os.urandom),
and the trainer's state is restored afterwards, so starting an engine does not move the trainer's random stream.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import random
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mppo.errors import UserError

# What torchrun (torch.distributed.elastic) sets for its workers; SGLang's processes are not its workers.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


class EngineStartError(UserError, RuntimeError):
    """An sglang.Engine did not start (its message says why, where SGLang's log is, and what to check)."""


@dataclass
class StartedEngine:
    """An sglang.Engine and the processes it started (this process's children that were not there before)."""

    engine: Any
    processes: list = field(default_factory=list)  # psutil.Process


class _ChildFailed(BaseException):
    """Raised by the SIGQUIT handler while the engine starts (BaseException: SGLang's own `except Exception` must
    not swallow it)."""


def start_engine(engine_cls: Callable[..., Any], server_args: dict[str, Any], *, log_path: Path | None,
                 what: str, on_cpu: bool) -> StartedEngine:
    """`engine_cls(**server_args)` with the failure handling of the module docstring; `what` names the engine in
    errors (e.g. "rollout group 1 (ranks 2-3)"). Stop it with `stop_engine`."""
    import psutil

    global _child_failed_raised
    _child_failed_raised = False
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    contexts_before = {id(ctx) for ctx in _zmq_contexts()}
    args = {**server_args, "custom_sigquit_handler": _raise_child_failed}
    spawn_env = contextlib.nullcontext()
    if on_cpu:
        from mppo.rollout.sglang_cpu import spawn_environment

        spawn_env = spawn_environment()
    error: str | None = None
    level = str(server_args.get("log_level", "error"))
    with _stderr_to(log_path), _logging_kept(log_path, level), spawn_env, _without_launcher_env(), \
            _fresh_python_random():
        try:
            engine = engine_cls(**args)
            signal.signal(signal.SIGQUIT, _after_start(what, log_path))
            return StartedEngine(engine, [p for p in psutil.Process().children() if p.pid not in before])
        except _ChildFailed:
            error = "its scheduler process failed"
        except Exception as exc:  # noqa: BLE001 - every start-up failure becomes the one error below
            error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0].rstrip(".")
        finally:
            if error is not None:
                # More than one of SGLang's processes may signal the failure (scheduler, detokenizer), and late
                # under load: one arriving once the default handler was back would kill the trainer (exit -3, no
                # message). This start is over and the trainer stops with the error below: SIGQUIT stays ignored.
                signal.signal(signal.SIGQUIT, signal.SIG_IGN)
                _kill_new_children(before)
                for ctx in _zmq_contexts():
                    if id(ctx) not in contexts_before and not ctx.closed:
                        ctx.destroy(linger=0)
    detail = _last_exception_line(log_path) if log_path is not None else None
    if detail and error == "its scheduler process failed":
        error = f"{error}: {detail.rstrip('.')}"
    where = f"; SGLang's log: {log_path}" if log_path is not None else ""
    raise EngineStartError(f"the SGLang engine of {what} did not start: {error}{where}. Check "
                           "actor_rollout_ref.rollout.gpu_memory_utilization and tensor_model_parallel_size, and "
                           "that the model at actor_rollout_ref.model.path is one SGLang supports")


def stop_engine(started: StartedEngine) -> None:
    """`engine.shutdown()`, with SGLang's kill of all this process's children narrowed to the engine's own
    processes (the module docstring says why)."""
    engine = started.engine
    # the namespace Engine.shutdown looks kill_process_tree up in (sglang.srt.entrypoints.engine)
    namespace = getattr(type(engine).shutdown, "__globals__", {})
    blanket_kill = namespace.get("kill_process_tree")
    if blanket_kill is None:  # not SGLang's Engine class (a test double): nothing to narrow
        engine.shutdown()
        return

    def kill_engine_processes(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid not in (None, os.getpid()) or include_parent:  # SGLang's other uses: a tree of its own
            return blanket_kill(parent_pid, include_parent=include_parent, skip_pid=skip_pid,
                                wait_timeout=wait_timeout)
        _kill_trees(started.processes, timeout=wait_timeout or 0)

    namespace["kill_process_tree"] = kill_engine_processes
    try:
        engine.shutdown()
    finally:
        namespace["kill_process_tree"] = blanket_kill
    atexit.unregister(engine.shutdown)  # SGLang registers it for exit, where it would kill every child again


def _kill_trees(processes: list, timeout: float) -> None:
    import psutil

    doomed = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            doomed += [*process.children(recursive=True), process]
    for process in doomed:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(doomed, timeout=timeout)  # reap them (no zombies)


_child_failed_raised = False  # module level, like the handler that reads it


def _raise_child_failed(signum: int, frame: Any) -> None:
    """The SIGQUIT handler during start-up (module level: SGLang pickles its server arguments). It raises once: a
    second signal must not interrupt the clean-up of the first."""
    global _child_failed_raised
    if _child_failed_raised:
        return
    _child_failed_raised = True
    raise _ChildFailed()


def _after_start(what: str, log_path: Path | None) -> Callable[[int, Any], None]:
    """SIGQUIT from an SGLang process after start-up (until SGLang installs its own running-phase handler, which
    kills the process tree): an error in the trainer instead of a silent kill."""
    def child_failed(signum, frame):
        where = f"; SGLang's log: {log_path}" if log_path is not None else ""
        raise EngineStartError(f"a process of the SGLang engine of {what} failed{where}")

    return child_failed


@contextlib.contextmanager
def _fresh_python_random() -> Iterator[None]:
    """Python's `random` seeded from os.urandom for the block, then back to the caller's state."""
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


_SGLANG_LOGGER = "sglang"
_sglang_log_handler: logging.Handler | None = None  # the one this module attached to SGLang's logger


@contextlib.contextmanager
def _logging_kept(log_path: Path | None, level: str) -> Iterator[None]:
    """The root logger's handlers and level as before the block (SGLang's start reconfigures them); SGLang's
    loggers of this process write to `log_path` at `level` from then on, not to the trainer's console."""
    global _sglang_log_handler
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(root_level)
        sglang = logging.getLogger(_SGLANG_LOGGER)
        sglang.setLevel(level.upper())
        if _sglang_log_handler is not None:  # an earlier engine's log (one engine per process at a time)
            sglang.removeHandler(_sglang_log_handler)
            _sglang_log_handler.close()
            _sglang_log_handler = None
        if log_path is not None:
            _sglang_log_handler = logging.FileHandler(log_path)
            _sglang_log_handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s %(message)s"))
            sglang.addHandler(_sglang_log_handler)
            sglang.propagate = False


@contextlib.contextmanager
def _without_launcher_env() -> Iterator[None]:
    """os.environ without torchrun's variables (see the module docstring), restored on exit."""
    saved = {key: os.environ.pop(key) for key in LAUNCHER_ENV if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _stderr_to(log_path: Path | None) -> Iterator[None]:
    """File descriptor 2 (this process's and the processes it spawns meanwhile) goes to `log_path`."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _kill_new_children(before: set[int]) -> None:
    """Stop the processes SGLang started before it failed (they would outlive the trainer otherwise)."""
    import psutil

    _kill_trees([child for child in psutil.Process().children(recursive=True) if child.pid not in before],
                timeout=10)


def _zmq_contexts() -> list:
    """Every live ZeroMQ context of this process (SGLang's engine makes its own; see the module docstring)."""
    import zmq

    # type(), not isinstance(): the latter reads __class__, which some module proxies answer with a warning
    return [obj for obj in gc.get_objects() if issubclass(type(obj), zmq.Context)]


def _last_exception_line(log_path: Path) -> str | None:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [m.group(0) for m in map(_EXCEPTION_LINE.match, (ln.strip() for ln in lines)) if m]
    return found[-1] if found else None
