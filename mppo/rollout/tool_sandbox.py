"""Run one tool call so that nothing it starts outlives it, reaches the network, or reaches into the trainer
(issue 24 item 2). What it does and does not isolate is listed in docs/RELIABILITY.md ("Tool sandbox").

A tool is a Python function of the trainer, so it runs in a fork: the *tool process*. It is PID 1 of a new PID
namespace (when it dies, the kernel kills every process in the namespace, whatever session or group they moved
to), in the trainer's one empty network namespace (made once and held by an fd: a new one per call costs ~15 ms,
entering it a few µs), leader of its own session, with RLIMIT_AS / NPROC / FSIZE / CPU / CORE, no new
privileges, PR_SET_PDEATHSIG, every inherited descriptor but its result pipe made /dev/null, every caught signal
back to its default, a fresh empty working directory and
environment and, when the trainer is root, an otherwise unused uid (the kernel does not enforce RLIMIT_NPROC for
uid 0). It writes its text, already cut, to the pipe; the trainer reads at most `max_bytes` + 1 bytes of it.

How the namespace is made depends on the privileges:
- root: the trainer's thread unshares a PID namespace for its next child, forks the tool process and goes back
  to its own (the namespace is per thread and only for children: the trainer itself never leaves its own); it
  kills and reaps the tool itself: one fork per call, as before.
- otherwise a *warden* forks first: it enters the held user and network namespaces and unshares the PID one
  (a multi-threaded trainer cannot), forks the tool process, enforces the timeout, and as child subreaper kills
  and reaps whatever is left, also where there is no PID namespace. The trainer stops it by closing a control
  pipe (its own death closes it too). This costs a second fork.
Only unreaped children are ever signalled (the trainer's tool process or warden, the warden's children, the tool's
group while its leader is unreaped), so no pid the kernel may have recycled is. What is missing is logged once.
"""
from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import gc
import logging
import math
import os
import re
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SandboxLimits", "Isolation", "isolation", "run_sandboxed"]

log = logging.getLogger("mppo")

_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_KEEPCAPS, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 8, 36, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH = 47, 2, 2
# Sandbox uids when the trainer is root: 0x70000000 + the tool's pid, above systemd's container range (up to
# 0x6FFFFFFF), so no real user owns them and two concurrent calls never share one (pids are < 2**22).
_UID_BASE, _UID_SPAN = 0x70000000, 1 << 22
_GRACE_S = 1.0  # how long the trainer waits for a warden beyond the timeout before it kills the warden itself
# outcomes (a warden's exit code); 64 + n: the tool process was killed by signal n
_OK, _FAILED, _TIMEOUT, _STOPPED, _NO_SANDBOX = 0, 1, 2, 3, 71
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # no libc to call: no namespaces, the rlimits and the session still apply
    _libc = None


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of a tool: each is a kernel rlimit of every process of the tool."""

    memory_mb: int | None = 1024  # RLIMIT_AS: MiB beyond the address space the fork inherits; None: no cap
    processes: int = 64  # RLIMIT_NPROC: processes and threads the tool may have at once
    file_mb: int = 64  # RLIMIT_FSIZE: largest file the tool may write, MiB
    cpu_s: int | None = None  # RLIMIT_CPU per process, s; None: the call's timeout (rounded up) + 1


@dataclass(frozen=True)
class Isolation:
    """What the sandbox can do on this machine, found out once per trainer process."""

    network: bool  # tools run in an empty network namespace
    pid_namespace: bool  # the tool process is PID 1 of its own namespace
    process_limit: str  # how RLIMIT_NPROC counts only the tool: "uid", "user namespace", "relative", "none"
    missing: tuple[str, ...]  # one line per isolation that is not available, and why


@dataclass(frozen=True)
class _Plan:
    isolation: Isolation
    net_fd: int | None  # the held network namespace
    user_fd: int | None  # the user namespace that owns it (unprivileged trainers)
    own_pid_fd: int | None  # the trainer's own PID namespace, to go back to (direct mode)
    direct: bool  # root with a PID namespace: no warden


def _c(name: str, *args: int) -> int:
    """0, or the errno of libc's `name`(*args) (ENOSYS without it); arguments as unsigned longs, as prctl wants."""
    fn = getattr(_libc, name, None) if _libc is not None else None
    if fn is None:
        return errno.ENOSYS
    return 0 if fn(*(ctypes.c_ulong(a) for a in args)) == 0 else ctypes.get_errno()


def _prctl(option: int, *args: int) -> int:
    """prctl with its unused arguments zero (some options refuse anything else with EINVAL)."""
    return _c("prctl", option, *args, *(0,) * (4 - len(args)))


def _why(err: int) -> str:
    return f"{errno.errorcode.get(err, err)}: {os.strerror(err)}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _spare_uid_mapped() -> bool:
    """Whether the sandbox uids exist in this user namespace (not in a rootless container mapping 65536 ids)."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        return False
    return any(inside <= _UID_BASE and _UID_BASE + _UID_SPAN <= inside + count for inside, _, count in ranges)


def _probe_child(root: bool, report: int, go: int) -> None:
    """In a throwaway child: make the network namespace, try the PID namespace (and, as root, going back from it
    and the uid switch), report the errnos, and live until the parent holds the namespace."""
    status = [errno.ENOSYS] * 3
    try:
        if root:
            status[0] = _c("unshare", _CLONE_NEWNET)
        else:
            uid, gid = os.geteuid(), os.getegid()
            status[0] = _c("unshare", _CLONE_NEWUSER | _CLONE_NEWNET)
            if status[0] == 0:  # map only ourselves: files the tool writes belong to the trainer's user
                for path, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{path}", "w") as f:
                        f.write(text)
        own = os.open("/proc/self/ns/pid", os.O_RDONLY)
        status[1] = _c("unshare", _CLONE_NEWPID) or (_c("setns", own, _CLONE_NEWPID) if root else 0)
        if root and _spare_uid_mapped():
            try:
                os.setresgid(_UID_BASE, _UID_BASE, _UID_BASE)
                os.setresuid(_UID_BASE, _UID_BASE, _UID_BASE)
                status[2] = 0
            except OSError as err:
                status[2] = err.errno or errno.EPERM
        os.write(report, struct.pack("<3i", *status))
        os.read(go, 1)
    finally:
        os._exit(0)


def _probe() -> _Plan:
    root = os.geteuid() == 0
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(go_w)
        _probe_child(root, report_w, go_r)
    os.close(report_w)
    os.close(go_r)
    net_fd = user_fd = own_pid_fd = None
    try:
        data = os.read(report_r, 12)
        net, pidns, uid = struct.unpack("<3i", data) if len(data) == 12 else (errno.EIO,) * 3
        if net == 0:
            net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            if not root:
                user_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        if root and pidns == 0:
            own_pid_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(go_w)
        os.close(report_r)
        os.waitpid(pid, 0)
    missing = []
    if net != 0:
        how = "unshare(CLONE_NEWNET)" if root else "unshare(CLONE_NEWUSER|CLONE_NEWNET)"
        missing.append(f"no network namespace ({how}: {_why(net)}): tools can reach the network")
    if pidns != 0:
        missing.append(f"no PID namespace (unshare(CLONE_NEWPID): {_why(pidns)}): only the warden's subreaper "
                       "walk kills what a tool leaves behind")
    if root and uid == 0:
        process_limit = "uid"
    elif root:
        process_limit = "none"
        missing.append("running as root with no spare uid to switch tools to (" + (
            _why(uid) if uid != errno.ENOSYS else f"uids {_UID_BASE:#x}.. are not mapped") + "): the kernel does "
            "not enforce RLIMIT_NPROC for root, so the number of a tool's processes is not limited")
    elif user_fd is not None and tuple(map(int, re.findall(r"\d+", os.uname().release)[:2])) >= (5, 14):
        process_limit = "user namespace"  # since 5.14 RLIMIT_NPROC counts per user namespace, before per user
    else:
        process_limit = "relative"  # the user's current count + the budget, taken as the call starts
    isolation = Isolation(net == 0, pidns == 0, process_limit, tuple(missing))
    return _Plan(isolation, net_fd, user_fd, own_pid_fd, own_pid_fd is not None)


_plan: _Plan | None = None
_plan_pid = -1
_plan_lock = threading.Lock()


def _current_plan() -> _Plan:
    global _plan, _plan_pid
    with _plan_lock:
        if _plan is None or _plan_pid != os.getpid():  # a forked trainer process probes again
            _plan, _plan_pid = _probe(), os.getpid()
            for line in _plan.isolation.missing:  # once per process: what tools are not kept from
                log.warning("tool sandbox: %s (docs/RELIABILITY.md, Tool sandbox)", line)
        return _plan


def isolation() -> Isolation:
    """What the tool sandbox isolates on this machine (probed once per process)."""
    return _current_plan().isolation


def _close_range(low: int, high: int) -> None:
    if low <= high and _c("close_range", low, min(high, 0xFFFFFFFF), 0) != 0:
        os.closerange(low, min(high + 1, os.sysconf("SC_OPEN_MAX")))


def _open_descriptors() -> list[int] | None:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None


def _close_inherited(keep: tuple[int, ...]) -> tuple[int, ...]:
    """Make every inherited descriptor but `keep` (returned, moved above 2 if needed) /dev/null.

    Not closed: C libraries remember descriptor numbers and act on them in every later fork of this process.
    libuv (uvloop, which SGLang installs as asyncio's loop) has a fork handler that closes the two numbers of its
    signal lock pipe and opens a new pipe, and a SIGCHLD handler that reads and writes them. Closed here, those
    numbers would be reused by the tool's own pipes, which the handler then closes or reads from in the tool's
    children (a tool that forks lost its own pipe: issue 24's "grandchild" flake). So every number up to the
    highest open one (holes too) names /dev/null, close-on-exec, and the tool's own descriptors come above it."""
    gc.freeze()  # objects inherited from the trainer are never finalized here: a finalizer would close whatever
    # descriptor got their old number next
    kept = tuple(fd if fd > 2 else fcntl.fcntl(fd, fcntl.F_DUPFD, 3) for fd in keep)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    open_fds = _open_descriptors()
    if open_fds is None:  # no /proc: close them (a library's remembered number may then be reused)
        low = 3
        for fd in sorted(set(kept)):
            _close_range(low, fd - 1)
            low = fd + 1
        _close_range(low, 0xFFFFFFFF)
        return kept
    for fd in range(3, max(open_fds) + 1):
        if fd not in kept and fd != devnull:
            os.dup2(devnull, fd, inheritable=False)
    return kept


def _user_tasks(uid: int) -> int:
    """Processes and threads of `uid` now (RLIMIT_NPROC counts them all), from /proc."""
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            pass
    return count


def _setrlimit(which: int, soft: int, hard: int) -> None:
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_MIN_HOLE = 64 << 10  # free chunks below this are left: only small C allocations could reuse them
_IS_MMAPPED = 0x2  # glibc's chunk header bit: the chunk is a mapping of its own


def _reserve_free_heap() -> None:
    """Allocate, without touching, the large free chunks the trainer's malloc already holds.

    RLIMIT_AS caps new address space only: a free chunk inside the inherited heap (the trainer freed a large
    tokenizer batch in the middle of it) would serve the tool's allocations beneath the cap (a 256 MiB bytearray
    under a 128 MiB limit, seen in CI). Trimming returns the top of the heap; the holes are taken by allocations
    of decreasing size, each kept only if it came from a hole: not a mapping of its own, the heap not grown
    (untouched, so no page is copied). glibc only (mallinfo2, glibc >= 2.33); other allocators are not reserved."""
    mallinfo2 = getattr(_libc, "mallinfo2", None) if _libc is not None else None
    if mallinfo2 is None:
        return
    mallinfo2.restype = _MallInfo2
    trim, malloc, free, sbrk = _libc.malloc_trim, _libc.malloc, _libc.free, _libc.sbrk
    trim.argtypes, malloc.argtypes, free.argtypes, sbrk.argtypes = (
        (ctypes.c_size_t,), (ctypes.c_size_t,), (ctypes.c_void_p,), (ctypes.c_ssize_t,))
    malloc.restype, sbrk.restype = ctypes.c_void_p, ctypes.c_void_p
    trim(0)
    size = mallinfo2().fordblks - 64  # one walk of the free lists: it costs a pass over every free chunk
    brk = sbrk(0)
    for _ in range(256):
        if size < _MIN_HOLE:
            return
        pointer = malloc(size)
        if pointer is None:
            size //= 2
            continue
        header = ctypes.c_size_t.from_address(pointer - ctypes.sizeof(ctypes.c_size_t)).value
        if header & _IS_MMAPPED or sbrk(0) != brk:
            free(pointer)
            trim(0)
            brk = sbrk(0)
            size //= 2
        # kept: it was a hole; the same size again, in case another hole holds it


def _apply_limits(limits: SandboxLimits, cpu_s: int, process_limit: str) -> None:
    if limits.memory_mb is not None:
        # the fork inherits the trainer's whole mapping (torch, the model): only new allocations count, and the
        # large free chunks malloc still holds are taken first
        _reserve_free_heap()
        with open("/proc/self/status") as status:
            size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
        cap = size_kb * 1024 + (limits.memory_mb << 20)
        _setrlimit(resource.RLIMIT_AS, cap, cap)
    processes = limits.processes + (_user_tasks(os.getuid()) if process_limit == "relative" else 0)
    _setrlimit(resource.RLIMIT_NPROC, processes, processes)
    _setrlimit(resource.RLIMIT_FSIZE, limits.file_mb << 20, limits.file_mb << 20)
    _setrlimit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    _setrlimit(resource.RLIMIT_CORE, 0, 0)  # a core of a trainer fork would be the trainer's size


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _set_capabilities(caps: int) -> None:
    """Keep only `caps` (a bit mask of the first 32) as effective, permitted and inheritable capabilities."""
    header, data = _CapHeader(0x20080522, 0), (ctypes.c_uint32 * 6)(caps, caps, caps, 0, 0, 0)
    if _libc is None or _libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _become(uid: int, workdir: str) -> None:
    """Switch a root tool process to `uid` (so the kernel counts its processes: it does not for root), keeping
    CAP_DAC_READ_SEARCH, also across exec (ambient): the trainer's Python and libraries may sit where only root
    can read (~root/.pyenv, a venv under /root), and a tool must still import them and run `python`. It reads
    what root reads; it writes only what its uid may (its working directory, world-writable places)."""
    os.chown(workdir, uid, uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    _prctl(_PR_SET_KEEPCAPS, 1)
    os.setresuid(uid, uid, uid)
    _set_capabilities(1 << _CAP_DAC_READ_SEARCH)
    if (err := _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH)) != 0:
        raise OSError(err, f"cannot keep CAP_DAC_READ_SEARCH across exec: {os.strerror(err)}")
    _prctl(_PR_SET_DUMPABLE, 1)  # its own /proc/self again (subprocess lists /proc/self/fd)


def _reset_signal_handlers() -> None:
    """Every caught signal back to its default: not the trainer's handlers, neither Python's (SGLang's SIGQUIT, a
    shutdown hook) nor C libraries' (libuv's SIGCHLD handler, which Python's signal module does not see). Ignored
    signals stay ignored (SIGPIPE and SIGXFSZ: Python's choice, so a write past a limit is an OSError)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # real-time signals glibc keeps for itself
            pass


def _set_up(plan: _Plan, limits: SandboxLimits, cpu_s: int, workdir: str, result: int, parent: int) -> int:
    """Everything the tool process does before the tool runs; the result pipe's descriptor."""
    os.setsid()
    if plan.direct and plan.net_fd is not None and (err := _c("setns", plan.net_fd, _CLONE_NEWNET)) != 0:
        raise OSError(err, f"cannot enter the sandbox's network namespace: {os.strerror(err)}")
    (result,) = _close_inherited((result,))
    _apply_limits(limits, cpu_s, plan.isolation.process_limit)
    if plan.isolation.process_limit == "uid":
        _become(_UID_BASE + int(os.readlink("/proc/self")) % _UID_SPAN, workdir)  # /proc/self: the host's pid
    elif plan.user_fd is not None:  # it would hold every capability over its namespaces
        _set_capabilities(0)
    for option, value in ((_PR_SET_NO_NEW_PRIVS, 1), (_PR_SET_PDEATHSIG, signal.SIGKILL)):
        if (err := _prctl(option, value)) not in (0, errno.ENOSYS):
            raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")
    # the parent died before PDEATHSIG was set: its pid is gone (PID 1 of a namespace always sees 0), or nobody
    # reads the result (POLLERR on a pipe whose read end is closed)
    poller = select.poll()
    poller.register(result, select.POLLOUT)
    if os.getppid() not in (0, parent) or any(event & select.POLLERR for _, event in poller.poll(0)):
        os._exit(_FAILED)
    os.chdir(workdir)
    kept = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    os.environ.clear()  # the trainer's secrets (tokens, keys) stay with the trainer
    os.environ.update(kept, HOME=workdir, TMPDIR=workdir, TMP=workdir, TEMP=workdir)
    tempfile.tempdir = workdir
    # the trainer's sys.stdout may be an object over a descriptor closed above (a tee, pytest's capture)
    sys.stdin, sys.stdout, sys.stderr = (open(fd, mode, closefd=False) for fd, mode in ((0, "r"), (1, "w"), (2, "w")))
    faulthandler.disable()  # it would write to the trainer's stderr's old number
    _reset_signal_handlers()
    return result


def _tool_process(fn: Callable[[], str], plan: _Plan, limits: SandboxLimits, cpu_s: int, workdir: str,
                  result: int, parent: int, max_bytes: int) -> None:
    text = ""
    try:
        try:
            result = _set_up(plan, limits, cpu_s, workdir, result, parent)
        except Exception as err:  # noqa: BLE001 - the tool does not run; the trainer gets why
            text = f"error: the tool sandbox could not be set up ({type(err).__name__}: {str(err)[:160]})"
        else:
            try:
                text = str(fn())
            except BaseException as err:  # noqa: BLE001 - everything the tool does becomes its message
                text = f"error: {type(err).__name__}: {str(err)[:200]}"
        _write_all(result, text.encode("utf-8", "replace")[:max_bytes])
    finally:
        os._exit(_OK)


def _children() -> list[int]:
    me = os.getpid()
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
        return found
    except OSError:  # no CONFIG_PROC_CHILDREN: read every process's parent
        for entry in os.scandir("/proc"):
            try:
                if entry.name.isdigit():
                    with open(f"/proc/{entry.name}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
        return found


def _reap_all() -> None:
    """Kill and reap every child of the warden: as subreaper it inherits whatever the tool left behind, also what
    moved to another group or session; each kill can orphan more, so repeat until there is none."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _outcome(pid: int, cpu_s: int) -> int:
    """Reap `pid` and say how it ended. PID 1 of a namespace ignores SIGXCPU (the kernel drops default-action
    signals to a namespace's init), so there the CPU limit shows as the SIGKILL at the hard limit."""
    _, status, usage = os.wait4(pid, 0)
    if not os.WIFSIGNALED(status):
        return _OK if os.WEXITSTATUS(status) == 0 else _FAILED
    cpu_limited = os.WTERMSIG(status) == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_s
    return 64 + (signal.SIGXCPU if cpu_limited else os.WTERMSIG(status))


def _watch(tool: int, control: int, deadline: float, cpu_s: int) -> int:
    """The warden's wait for the tool process, the deadline or the trainer's stop; then it kills the tool's group
    while the tool is unreaped (so the group's id is still the tool's) and reaps it."""
    try:
        pidfd: int | None = os.pidfd_open(tool)
    except (AttributeError, OSError):
        pidfd = None
    poller = select.poll()
    poller.register(control, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    outcome = None
    while outcome is None:
        left = deadline - time.monotonic()
        if left <= 0:
            outcome = _TIMEOUT
            break
        ready = {fd for fd, _ in poller.poll(1000 * (left if pidfd is not None else min(left, 0.01)))}
        # its exit first: the trainer stops the warden as soon as the result pipe closes, i.e. as the tool dies
        if os.waitid(os.P_PID, tool, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            outcome = _OK  # exited, not reaped
        elif control in ready:
            outcome = _STOPPED
    try:
        os.killpg(tool, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code = _outcome(tool, cpu_s)
    return code if outcome == _OK else outcome


def _warden(fn: Callable[[], str], plan: _Plan, limits: SandboxLimits, cpu_s: int, timeout_s: float,
            workdir: str, result: int, control: int, max_bytes: int) -> None:
    code = _NO_SANDBOX
    try:
        deadline = time.monotonic() + timeout_s
        os.setsid()
        for fd, kind, name in ((plan.user_fd, _CLONE_NEWUSER, "user"), (plan.net_fd, _CLONE_NEWNET, "network")):
            if fd is not None and (err := _c("setns", fd, kind)) != 0:
                raise OSError(err, f"cannot enter the sandbox's {name} namespace: {os.strerror(err)}")
        if plan.isolation.pid_namespace and (err := _c("unshare", _CLONE_NEWPID)) != 0:
            raise OSError(err, f"cannot make a PID namespace: {os.strerror(err)}")
        result, control = _close_inherited((result, control))
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        warden = os.getpid()
        tool = os.fork()
        if tool == 0:
            os.close(control)
            _tool_process(fn, plan, limits, cpu_s, workdir, result, warden, max_bytes)
        os.close(result)
        code = _watch(tool, control, deadline, cpu_s)
        _reap_all()
    except Exception as err:  # noqa: BLE001 - fail closed: no tool runs in a sandbox missing a part
        _write_all(result, f"error: the tool sandbox could not be set up ({str(err)[:160]})".encode())
    finally:
        os._exit(code)


def _fork_direct(plan: _Plan) -> int:
    """Fork with the child as PID 1 of a new PID namespace; this thread's own children go on in its own."""
    if (err := _c("unshare", _CLONE_NEWPID)) != 0:
        raise OSError(err, f"cannot make a PID namespace: {os.strerror(err)}")
    pid = -1
    try:
        pid = os.fork()
        return pid
    finally:
        if pid != 0 and (err := _c("setns", plan.own_pid_fd, _CLONE_NEWPID)) != 0:  # would be a bug: say it loudly
            log.error("tool sandbox: this thread cannot go back to its PID namespace (%s); its next child would be "
                      "PID 1 of a tool's", _why(err))


def _wait(pid: int, timeout_s: float) -> int:
    """The exit status of our child `pid`, killed first if it has not exited within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            return os.waitpid(pid, 0)[1]
        time.sleep(0.0005)  # the warden exits right after its tool: this loop rarely turns
    return done[1]


def _read_bounded(fd: int, limit: int, deadline: float) -> tuple[bytes, bool]:
    """At most `limit` + 1 bytes from `fd`, until EOF or the deadline; and whether the deadline passed."""
    data = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while len(data) <= limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(data), True
        if poller.poll(1000 * left):
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    return bytes(data), False


def _remove(workdir: str) -> None:
    def force(func, path, _exc):  # a tool may have taken the permissions off its files
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass
    shutil.rmtree(workdir, onerror=force)


def _message(outcome: int, text: str, timeout_s: float, cpu_s: int) -> str:
    if outcome == _TIMEOUT:
        return f"error: the tool did not finish within {timeout_s:g} s"
    if text:
        return text
    if outcome == 64 + signal.SIGXCPU:
        return f"error: the tool used up its CPU time ({cpu_s} s)"
    if 64 < outcome < 128:
        try:
            return f"error: the tool was killed by {signal.Signals(outcome - 64).name}"
        except ValueError:
            return f"error: the tool was killed by signal {outcome - 64}"
    if outcome == _NO_SANDBOX:
        return "error: the tool sandbox could not start"
    return "error: the tool exited without a result"


def run_sandboxed(fn: Callable[[], str], *, timeout_s: float, limits: SandboxLimits | None = None,
                  max_bytes: int = 1 << 16) -> str:
    """`fn()` run in the sandbox, as text: its result (at most `max_bytes` of UTF-8), or an `error: ...` line for
    an exception, a timeout, a kill by a limit or a sandbox that could not start. Never raises; returns within
    about `timeout_s` (+ 1 s at worst); nothing `fn` started is left running."""
    limits = limits or SandboxLimits()
    cpu_s = limits.cpu_s if limits.cpu_s is not None else math.ceil(timeout_s) + 1
    plan = _current_plan()
    fds: list[int] = []
    child, workdir = -1, ""
    try:
        workdir = tempfile.mkdtemp(prefix="mppo-tool-")
        fds += os.pipe()  # result: read, write
        fds += os.pipe() if not plan.direct else (-1, -1)  # the warden's control pipe: read, write
        parent = os.getpid()
        child = _fork_direct(plan) if plan.direct else os.fork()
        if child == 0:
            if plan.direct:
                _tool_process(fn, plan, limits, cpu_s, workdir, fds[1], parent, max_bytes)
            _warden(fn, plan, limits, cpu_s, timeout_s, workdir, fds[1], fds[2], max_bytes)
        for i in (1, 2):  # the child's ends
            if fds[i] >= 0:
                os.close(fds[i])
                fds[i] = -1
        grace = 0 if plan.direct else _GRACE_S  # a warden keeps the time itself; this is its backstop
        data, late = _read_bounded(fds[0], max_bytes, time.monotonic() + timeout_s + grace)
        if plan.direct:
            os.kill(child, signal.SIGKILL)  # PID 1 of its namespace: everything in it dies with it
            code = _outcome(child, cpu_s)
            outcome = _TIMEOUT if late else code
        else:
            os.close(fds[3])  # the warden stops whatever still runs
            fds[3] = -1
            status = _wait(child, _GRACE_S)
            outcome = _TIMEOUT if late else os.WEXITSTATUS(status) if os.WIFEXITED(status) else _NO_SANDBOX
        child = -1
    except OSError as err:
        return f"error: the tool sandbox could not start ({type(err).__name__}: {err})"
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        if child > 0:  # an exception above: leave nothing behind
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        if workdir:
            _remove(workdir)
    return _message(outcome, data[:max_bytes].decode("utf-8", "replace"), timeout_s, cpu_s)
