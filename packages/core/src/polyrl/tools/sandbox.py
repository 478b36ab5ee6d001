"""A sandbox for untrusted Python: one process tree per call, OS-enforced limits, no network, no host files.

Each call runs in a fresh child process that

* starts in new Linux namespaces (``unshare``, util-linux): user (the child is "root" only inside it,
  with every capability dropped before the code runs; when the trainer runs as root, the namespace's root
  is the unprivileged ``nobody`` (65534) on the host, never the host's root), network (no interface but a
  down loopback), mount, PID, IPC and UTS;
* sees a new root filesystem: a small read-only tmpfs holding read-only bind mounts of ``/usr``,
  ``/lib*``, ``/bin``, ``/sbin``, ``/etc`` and the Python installation, ``/dev/null``/``/dev/urandom``,
  its own ``/proc``, and ``/scratch`` (a fresh tmpfs of ``scratch_mb``, the only writable place, gone after
  the call).
  The trainer's working tree, run directory, home, ``/tmp`` and virtualenv are not mounted;
* drops every capability (``setpriv --bounding-set=-all --no-new-privs``) before the code runs, so it
  cannot undo those mounts;
* runs ``python -I -S`` (the standard library only, no site-packages) with an empty environment
  (``PATH``, ``HOME=/scratch`` and ``LANG`` only);
* under resource limits (``setrlimit``: ``prlimit`` on the child, and inside the namespace for processes and
  open files): CPU seconds, address space, processes, open files, file size, no core dumps.

**No process of a call outlives it.** The first Python process of the call is a small *supervisor*
(:data:`_BOOT`), not the model's code: it forks the program, reaps whatever is orphaned to it, and reports
the program's real wait status (exit code or signal, CPU time) on a pipe the program does not hold (the
program holds no descriptor but its stdio; an uncaught ``MemoryError`` is told by the exit status
:data:`MEMORY_ERROR_STATUS`, so a program can claim no more than what raising it would give). With ``namespaces`` the supervisor is PID 1 of the call's PID namespace: when it
exits (right after the program's main process ends) or is killed (wall time), the kernel kills every other
process of the namespace, whatever they did (``setsid``, double fork, ignored signals), before the call
returns. The program cannot move or kill PID 1 (it is not its parent, signals from inside a namespace to
its init are dropped, and the supervisor is not dumpable, so it cannot be ptraced). With ``none`` the
supervisor is a child subreaper that kills and reaps every descendant when the program ends, and where the
trainer may create cgroup v2 groups, every call runs in its own cgroup, killed as a whole
(``cgroup.kill``) at the end; see docs/agents.md for what each level guarantees.

What happened is reported as it happened (:class:`SandboxResult`): the exit code (a program's own
``sys.exit(152)`` is exit code 152, nothing else), the signal, which limit was hit (``cpu``: killed by
``SIGXCPU`` or by ``SIGKILL`` at the hard limit after using its CPU seconds; ``wall``; ``memory``: the
program died of ``MemoryError`` under the address-space limit; ``file_size``; ``output``: more output than
the sandbox reads), the output (the program's stdout and stderr, in order; the sandbox's own diagnostics
never mix into it) and, when it was longer than ``max_output_bytes``, how many bytes were dropped from its
middle.

Where the setup is not permitted (some containers; probed once by running it on ``pass``),
``isolation="namespaces"`` fails every call with a message saying so; a setup failure of one call is
``error="sandbox setup failed: ..."``.
``isolation="none"`` runs with the limits and the empty environment only, in a scratch directory, which is
*not* a security boundary (see docs/agents.md).
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import itertools
import logging
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("polyrl")

#: The sandbox's user on the host when the trainer runs as root: the namespace's root is mapped to this
#: unprivileged uid/gid (``nobody``), never to the host's root.
SANDBOX_UID = 65534

#: The sandbox reads at most this many times ``max_output_bytes`` of output (keeping the first and last
#: parts); a program that writes more is stopped (limit ``output``).
OUTPUT_READ_FACTOR = 64
#: The exit status the program's process ends with when it dies of an uncaught ``MemoryError`` (reported as exit
#: status 1 and ``limit="memory"``, like a plain Python process that runs out of its address space).
MEMORY_ERROR_STATUS = 213

#: Root trainers only, in a private mount namespace without a user namespace (still the host's root, so it
#: can reach a Python installed under a private home such as /root/.pyenv): binds the Python prefix ($1)
#: onto $2 (a directory the unprivileged sandbox user can reach), then runs the rest ($3...).
_STAGE_ROOT = r"""
set -e
mount --bind "$1" "$2"
shift 2
exec "$@"
"""

#: Builds the new root inside the namespaces, then drops capabilities and starts Python.
#: Arguments: $1 the call's work dir (root/ = mount point of the new root, prog/ = the program files),
#: $2 python prefix (its path inside), $3 python executable, $4 where to bind the prefix from,
#: $5 size of the /scratch tmpfs in MiB.
_SETUP = r"""
set -e
R="$1/root"
mount -t tmpfs -o size=4m,mode=755 tmpfs "$R"
for d in /usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc; do
  [ -e "$d" ] || continue
  if [ -L "$d" ]; then mkdir -p "$R$(dirname "$d")"; ln -s "$(readlink "$d")" "$R$d"; continue; fi
  mkdir -p "$R$d"
  mount --rbind "$d" "$R$d"
  mount -o remount,bind,ro,nosuid,nodev "$R$d"
done
mkdir -p "$R$2"
mount --rbind "$4" "$R$2"
mount -o remount,bind,ro,nosuid,nodev "$R$2"
mkdir -p "$R/scratch" "$R/dev" "$R/proc" "$R/tmp" "$R/.oldroot"
mount -t tmpfs -o "size=$5m,nr_inodes=16384,mode=755,nosuid,nodev" tmpfs "$R/scratch"
cp "$1/prog/main.py" "$1/prog/.polyrl_boot.py" "$R/scratch/"
for f in null zero urandom random; do touch "$R/dev/$f"; mount --bind "/dev/$f" "$R/dev/$f"; done
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
echo 0 > /proc/sys/user/max_user_namespaces 2>/dev/null || true
cd "$R"
pivot_root . .oldroot
cd /
umount -l /.oldroot
mount -o remount,ro,bind /
cd /scratch
exec /usr/bin/env -i PATH=/usr/bin:/bin HOME=/scratch LANG=C.UTF-8 \
  /usr/bin/setpriv --no-new-privs --inh-caps=-all --bounding-set=-all -- \
  "$3" -I -S /scratch/.polyrl_boot.py
"""

#: ``newuidmap`` / ``newgidmap`` stand-ins for ``unshare --map-users/--map-groups`` (util-linux runs them,
#: as the trainer's root, to write the new namespace's id map): $1 pid, $2 inner id, $3 outer id, $4 count.
_IDMAP_HELPER = """#!/bin/sh
printf '%s %s %s\\n' "$2" "$3" "$4" > "/proc/$1/{file}"
"""

#: The call's supervisor (``CONFIG = {...}`` is prepended): tells the parent the setup worked (``R`` on the
#: status pipe), forks the program, reaps every process orphaned to it until the program's main process
#: ends, ends every other process of the call (``namespaces``: by exiting, as PID 1 of the call's PID
#: namespace; ``none``: as a child subreaper, by killing and reaping every descendant), then writes the
#: program's wait status on the status pipe. The program runs in the forked child, with
#: the namespace's process and file limits, its stderr on its stdout, default signal dispositions. (The
#: report is a Python literal, not JSON: importing json would cost the supervisor 20 ms.)
_BOOT = """\
import os, signal, sys, time

STATUS_FD = CONFIG["status_fd"]


def prctl(option, value):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:
        pass


class Stop(BaseException):
    pass


def stop(*_):
    raise Stop()


def children():
    me, found = str(os.getpid()).encode(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(b")") + 2:].split()[1] == me:
                found.append(int(name))
    return found


def sweep(usage):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = children()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaped = 0
        while True:
            try:
                pid, _, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            reaped += 1
            usage[0] += ru.ru_utime + ru.ru_stime
        if not kids and not reaped:
            time.sleep(0.002)


os.write(STATUS_FD, b"R")
QUIET = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
for sig in QUIET:
    signal.signal(sig, signal.SIG_IGN)
prctl(4, 0)  # PR_SET_DUMPABLE 0: the program cannot ptrace the supervisor or open its /proc files
if not CONFIG["namespaces"]:
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the program (setsid, double fork) stay below us
    signal.signal(signal.SIGTERM, stop)  # the parent's "time is up": end every process of the call
main = os.fork()
if main == 0:
    os.close(STATUS_FD)  # the program holds no descriptor of the supervisor's: it cannot write into the report
    prctl(4, 1)  # the program itself is dumpable as usual (its own /proc files); the supervisor stays not
    for sig in QUIET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if CONFIG["cgroup"]:
        try:
            with open(CONFIG["cgroup"] + "/cgroup.procs", "w") as f:
                f.write("0")
        except OSError:
            pass
    import resource
    if CONFIG["namespaces"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (CONFIG["nproc"], CONFIG["nproc"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (CONFIG["nofile"], CONFIG["nofile"]))
    os.dup2(1, 2)
    sys.stdout.reconfigure(line_buffering=True)  # lines in the order written, as on a terminal
    os.chdir(CONFIG["workdir"])
    sys.argv = ["main.py"]
    sys.path.insert(0, CONFIG["workdir"])
    try:
        with open(CONFIG["workdir"] + "/main.py") as f:
            source = f.read()
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as exc:  # the program's traceback, without this file's frame
        import traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        # the only word from the program's process: its exit status (an uncaught MemoryError: MEMORY_ERROR_STATUS)
        sys.exit(CONFIG["memory_error_status"] if isinstance(exc, MemoryError) else 1)
    sys.exit(0)
devnull = os.open("/dev/null", os.O_RDWR)
os.dup2(devnull, 1)  # only the program holds the output pipe
report = {"stopped": False}
usage = [0.0]
try:
    while True:
        try:
            pid, status, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        usage[0] += ru.ru_utime + ru.ru_stime
        if pid == main:
            report.update(status=status, main_cpu_s=ru.ru_utime + ru.ru_stime, max_rss_kb=ru.ru_maxrss)
            break
except Stop:
    report["stopped"] = True
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if not CONFIG["namespaces"]:
    sweep(usage)
report["cpu_s"] = usage[0]
os.write(STATUS_FD, repr(report).encode())
os._exit(0)  # nothing to flush; skips the interpreter's teardown
"""


@dataclass
class SandboxLimits:
    """Limits of one sandboxed call."""

    #: Wall-clock seconds before the call's processes are killed.
    timeout_s: float = 10.0
    #: CPU seconds (``RLIMIT_CPU``, per process: ``SIGXCPU`` at ``cpu_s``, ``SIGKILL`` one second later).
    cpu_s: int = 10
    #: Address space in MiB (``RLIMIT_AS``).
    memory_mb: int = 512
    #: Processes / threads (``RLIMIT_NPROC``, counted inside the sandbox's user namespace).
    max_processes: int = 16
    #: Largest file the code may write, MiB (``RLIMIT_FSIZE``).
    max_file_mb: int = 16
    #: Open file descriptors (``RLIMIT_NOFILE``).
    max_open_files: int = 64
    #: Size of the ``/scratch`` tmpfs, MiB: all files the code writes together (memory, not disk).
    scratch_mb: int = 64
    #: Bytes of stdout + stderr kept (the first and the last half); the middle of longer output is dropped
    #: and counted. A program that writes more than :data:`OUTPUT_READ_FACTOR` times this is stopped.
    max_output_bytes: int = 16384


@dataclass
class SandboxResult:
    """What a sandboxed call did, as it happened."""

    #: The program's stdout and stderr, in order (the middle of long output replaced by a marker line).
    stdout: str
    #: Always empty: stderr is merged into ``stdout`` (kept for compatibility).
    stderr: str
    #: The program's exit code, ``-N`` when signal N ended it, ``None`` when it was killed for wall time.
    returncode: int | None
    timed_out: bool = False
    #: Output was longer than ``max_output_bytes``: ``dropped_bytes`` from its middle are not in ``stdout``.
    truncated: bool = False
    duration_s: float = 0.0
    #: Why the call did not run to its own end: a limit hit or the sandbox failing (``None`` when the
    #: program ended by itself, whatever its exit code).
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: The signal that ended the program, if one did.
    signal: int | None = None
    #: The limit that ended the program: ``cpu``, ``wall``, ``memory``, ``file_size``, ``output``.
    limit: str | None = None
    #: Bytes of output dropped from the middle (see ``truncated``).
    dropped_bytes: int = 0

    @property
    def ok(self) -> bool:
        """Exited with status 0 within its limits."""
        return self.error is None and not self.timed_out and self.returncode == 0

    def describe(self) -> str:
        """One line saying how the call ended (``exited with status 3``, ``CPU time limit ... (SIGXCPU)``)."""
        if self.error is not None:
            line = self.error
        elif self.signal is not None:
            line = f"killed by signal {_signal_name(self.signal)}"
        else:
            line = f"exited with status {self.returncode}"
        if self.dropped_bytes:
            line += f"; output truncated: {self.dropped_bytes} bytes dropped from its middle"
        return line


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


#: Where the sandbox's programs are looked up (``pivot_root`` is in an sbin, which a user's PATH may lack).
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

_NS_PROBE: tuple[bool, str] | None = None
_PROBE_LOCK = threading.Lock()


def namespaces_available() -> tuple[bool, str]:
    """Whether this machine lets the sandbox build its isolation (checked once per process, by running the
    real setup on ``pass``)."""
    global _NS_PROBE
    if any(shutil.which(p, path=_PATH) is None for p in ("unshare", "setpriv", "pivot_root", "prlimit")):
        return False, "the 'unshare', 'setpriv', 'pivot_root' and 'prlimit' programs (util-linux) are not installed"
    with _PROBE_LOCK:
        if _NS_PROBE is None:
            probe = Sandbox(SandboxLimits(timeout_s=20, cpu_s=10))._run_isolated("pass")
            if probe.ok:
                _NS_PROBE = (True, "")
            else:
                detail = probe.error or probe.describe()
                if probe.stdout.strip():
                    detail += f" (output: {probe.stdout.strip()[-400:]})"
                _NS_PROBE = (False, (
                    "this machine does not permit the sandbox's user + network + mount + PID namespaces, tmpfs "
                    "and proc mounts (a container without CAP_SYS_ADMIN or with a masked /proc, "
                    "kernel.unprivileged_userns_clone=0, or an AppArmor / SELinux policy restricting user "
                    f"namespaces); the probe said: {detail}"))
    return _NS_PROBE


_CGROUP_BASE: str | None | bool = False  # False: not probed yet; None: no usable cgroup v2
_CGROUP_LOCK = threading.Lock()
_CGROUP_IDS = itertools.count()


def cgroup_base() -> str | None:
    """The trainer's own cgroup v2 directory when it may create child groups there (with ``cgroup.kill``,
    Linux 5.14+), else ``None``; ``isolation="none"`` then runs each call in its own child group. Probed once
    per process by creating and removing one."""
    global _CGROUP_BASE
    with _CGROUP_LOCK:
        if _CGROUP_BASE is False:
            _CGROUP_BASE = _probe_cgroup()
        return _CGROUP_BASE  # type: ignore[return-value]


def _probe_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            own = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
        mount = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    mount = left.split()[4]
                    break
        if own is None or mount is None:
            return None
        base = os.path.join(mount, own.lstrip("/"))
        probe = os.path.join(base, f"polyrl-sandbox-probe-{os.getpid()}")
        os.mkdir(probe)
        try:
            usable = os.path.exists(os.path.join(probe, "cgroup.kill"))
        finally:
            os.rmdir(probe)
        return base if usable else None
    except (OSError, ValueError, IndexError):
        return None


_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()
#: Threads for :meth:`Sandbox.arun`: each waits on one sandboxed process, so there are enough for every
#: concurrent call of a large rollout batch (the default asyncio pool, min(32, CPUs + 4), would queue calls).
SANDBOX_THREADS = 512


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(SANDBOX_THREADS, thread_name_prefix="polyrl-sandbox")
        return _EXECUTOR


class Sandbox:
    """Runs Python source in a fresh, isolated process tree per call (see the module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None, *, isolation: str = "namespaces",
                 python: str | None = None) -> None:
        if isolation not in ("namespaces", "none"):
            raise ValueError(f"sandbox isolation={isolation!r}: choose 'namespaces' or 'none'")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        # the base interpreter (a virtualenv's python is a symlink into a tree the sandbox does not mount)
        self.python = python or getattr(sys, "_base_executable", None) or sys.executable
        self.python = os.path.realpath(self.python)
        self.prefix = os.path.realpath(sys.base_prefix)

    def _prlimit(self) -> list[str]:
        """``prlimit`` options (util-linux) for the limits that hold across the namespaces: set on the child
        by the kernel before anything runs, with no Python code between fork and exec (thread-safe)."""
        lim = self.limits
        opts = [f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb << 20}", f"--fsize={lim.max_file_mb << 20}",
                "--core=0"]
        if self.isolation == "none":  # no namespace: the process and file limits go here too
            opts += [f"--nproc={lim.max_processes}", f"--nofile={lim.max_open_files}"]
        return ["prlimit", *opts, "--"]

    def _boot(self, status_fd: int, workdir: str, cgroup: str | None) -> str:
        config = {"status_fd": status_fd, "namespaces": self.isolation == "namespaces", "workdir": workdir,
                  "cgroup": cgroup or "", "nproc": self.limits.max_processes, "nofile": self.limits.max_open_files,
                  "memory_error_status": MEMORY_ERROR_STATUS}
        return f"CONFIG = {config!r}\n" + _BOOT

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as ``main.py`` and return what happened; never raises for what the code does."""
        if self.isolation == "namespaces":
            ok, why = namespaces_available()
            if not ok:
                return SandboxResult("", "", None, error=(
                    f"python sandbox unavailable: {why}. Install util-linux / run where namespaces are allowed, "
                    "or set the python tool's isolation: none (limits only, NOT a security boundary)."))
            return self._run_isolated(code)
        scratch = tempfile.mkdtemp(prefix="polyrl-scratch-")
        cgroup = _new_cgroup()
        status = list(os.pipe())
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            boot = os.path.join(scratch, ".polyrl_boot.py")
            with open(boot, "w") as f:
                f.write(self._boot(status[1], scratch, cgroup))
            cmd = [*self._prlimit(), self.python, "-I", "-S", boot]
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"}
            return self._communicate(cmd, env, scratch, status, cgroup=cgroup)
        finally:
            _close_pipe(status)
            if cgroup:
                _remove_cgroup(cgroup)
            shutil.rmtree(scratch, ignore_errors=True)

    def _run_isolated(self, code: str) -> SandboxResult:
        """The namespaced run. The call's work dir (created here, removed in ``finally``; nothing is created
        in the host's ``/tmp`` inside the sandbox) holds the new root's mount point and the program files,
        which the setup copies into a size-limited tmpfs mounted on ``/scratch``."""
        lim = self.limits
        work = tempfile.mkdtemp(prefix="polyrl-sbx-")
        status_r, status_w = os.pipe()
        status = [status_r, status_w]
        try:
            os.chmod(work, 0o755)  # reachable (not writable) by the unprivileged sandbox user
            for sub in ("root", "prog", "py", "bin"):
                os.mkdir(os.path.join(work, sub), 0o755)
            with open(os.path.join(work, "prog", "main.py"), "w") as f:
                f.write(code)
            with open(os.path.join(work, "prog", ".polyrl_boot.py"), "w") as f:
                f.write(self._boot(status_w, "/scratch", None))
            for name in ("main.py", ".polyrl_boot.py"):
                os.chmod(os.path.join(work, "prog", name), 0o644)
            ns = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
            setup = ["/bin/sh", "-c", _SETUP, "polyrl-sandbox", work, self.prefix, self.python]
            env = {"PATH": _PATH}
            if os.geteuid() == 0:
                # never map the namespace's root to the host's root: it would read root-only host files and
                # RLIMIT_NPROC does not apply to the host's root. util-linux runs newuidmap/newgidmap for
                # --map-users/--map-groups; the trainer is root, so the call's own stand-ins write the maps.
                for prog, file in (("newuidmap", "uid_map"), ("newgidmap", "gid_map")):
                    helper = os.path.join(work, "bin", prog)
                    with open(helper, "w") as f:
                        f.write(_IDMAP_HELPER.format(file=file))
                    os.chmod(helper, 0o755)
                env["PATH"] = f"{work}/bin:" + env["PATH"]
                py_src = os.path.join(work, "py")
                cmd = [*self._prlimit(), "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                       _STAGE_ROOT, "polyrl-sandbox-root", self.prefix, py_src,
                       "unshare", "--user", f"--map-users={SANDBOX_UID},0,1", f"--map-groups={SANDBOX_UID},0,1",
                       "--setuid", "0", "--setgid", "0", *ns, *setup, py_src, str(lim.scratch_mb)]
            else:
                cmd = [*self._prlimit(), "unshare", "--user", "--map-root-user", *ns, *setup, self.prefix,
                       str(lim.scratch_mb)]
            return self._communicate(cmd, env, work, status)
        finally:
            _close_pipe(status)
            shutil.rmtree(work, ignore_errors=True)

    def _communicate(self, cmd: list[str], env: dict[str, str], cwd: str, status: list[int],
                     cgroup: str | None = None) -> SandboxResult:
        """Run ``cmd`` and collect the program's output and status within the limits; ``status`` is the
        supervisor's status pipe (read end, write end), whose write end this closes (and sets to -1) once the
        child has it. Returns only when every process of the call is gone."""
        lim = self.limits
        start = time.monotonic()
        deadline = start + lim.timeout_s
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, env=env, cwd=cwd,
                                    start_new_session=True, close_fds=True, pass_fds=(status[1],))
        except OSError as exc:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            return SandboxResult("", "", None, error=f"python sandbox could not start: {exc}")
        finally:
            if status[1] >= 0:
                os.close(status[1])  # only the sandbox holds the write ends now (EOF once it is gone)
                status[1] = -1
        os.close(out_w)
        os.close(err_w)
        output = _Output(lim.max_output_bytes)
        diagnostics = bytearray()  # the sandbox machinery's stderr (unshare, mount, the supervisor)
        timed_out = overflow = False
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ, "out")
        sel.register(err_r, selectors.EVENT_READ, "err")
        try:
            # read until every holder of the output is gone: the program's processes end with the call
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                    elif key.data == "out":
                        output.add(chunk)
                    else:
                        diagnostics += chunk
                        del diagnostics[:-8192]
                if output.total > OUTPUT_READ_FACTOR * lim.max_output_bytes:
                    overflow = True
                    break
            if not (timed_out or overflow) and not _wait_exited(proc.pid, deadline):
                timed_out = True
            if timed_out or overflow:
                self._stop(proc)
        finally:
            sel.close()
            _end_call(proc, cgroup)
            os.close(out_r)
            os.close(err_r)
        duration = time.monotonic() - start
        return self._result(output, bytes(diagnostics), _read_status(status[0]), proc.returncode,
                            timed_out=timed_out, overflow=overflow, duration=duration)

    def _stop(self, proc: subprocess.Popen) -> None:
        """End a call that ran out of time or output: every process of it, before returning."""
        if self.isolation == "namespaces":
            # the supervisor is PID 1 of the call's PID namespace (unshare's child): killing it kills the
            # namespace; the pidfd tells when that is done (PID 1 exits after every other process of it)
            pidfd = _child_pidfd(proc.pid)
            _kill_group(proc.pid)
            if pidfd is not None:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                select.select([pidfd], [], [], 10.0)
                os.close(pidfd)
            return
        # no namespace: the supervisor (a subreaper) kills and reaps every descendant, then exits
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        _wait_exited(proc.pid, time.monotonic() + 5.0)

    def _result(self, output: _Output, diagnostics: bytes, report: tuple[bool, dict | None], rc: int | None, *,
                timed_out: bool, overflow: bool, duration: float) -> SandboxResult:
        lim = self.limits
        setup_ok, status = report
        text = output.text()
        diag = diagnostics.decode("utf-8", errors="replace").strip()
        metrics = {"cpu_s": float((status or {}).get("cpu_s", 0.0))}
        if status and status.get("max_rss_kb"):
            metrics["max_rss_mb"] = status["max_rss_kb"] / 1024
        common: dict[str, Any] = dict(truncated=output.dropped > 0, dropped_bytes=output.dropped,
                                      duration_s=duration, metrics=metrics)
        if timed_out:
            return SandboxResult(text, "", None, timed_out=True, limit="wall", **common,
                                 error=f"timed out after {lim.timeout_s:g}s wall time (killed)")
        if overflow:
            return SandboxResult(text, "", None, limit="output", **common,
                                 error=f"output limit exceeded: the program wrote more than "
                                       f"{OUTPUT_READ_FACTOR * lim.max_output_bytes} bytes and was stopped")
        if not setup_ok:
            return SandboxResult(text, "", rc, **common,
                                 error="sandbox setup failed: " + (diag[-1000:] or f"exit status {rc}"))
        if status is None or "status" not in status:
            return SandboxResult(text, "", rc, **common, error=(
                "the sandbox's supervisor ended without reporting the program's status (exit status "
                f"{rc}){': ' + diag[-500:] if diag else ''}"))
        raw = int(status["status"])
        if os.WIFSIGNALED(raw):
            sig = os.WTERMSIG(raw)
            cpu = float(status.get("main_cpu_s", 0.0))
            name = _signal_name(sig)
            if sig == signal.SIGXCPU:
                limit, error = "cpu", f"CPU time limit of {lim.cpu_s} s exceeded (killed by SIGXCPU)"
            elif sig == signal.SIGKILL and cpu >= lim.cpu_s:
                limit, error = "cpu", (f"CPU time limit of {lim.cpu_s} s exceeded (killed by SIGKILL at the hard "
                                       "limit: the program ignored SIGXCPU)")
            elif sig == signal.SIGXFSZ:
                limit, error = "file_size", f"file size limit of {lim.max_file_mb} MiB exceeded (killed by SIGXFSZ)"
            else:
                limit, error = None, f"killed by signal {name}"
            return SandboxResult(text, "", -sig, signal=sig, limit=limit, error=error, **common)
        code = os.WEXITSTATUS(raw)
        if code == MEMORY_ERROR_STATUS:
            code = 1  # Python's own status for an uncaught exception
            return SandboxResult(text, "", code, limit="memory", **common, error=(
                f"memory limit of {lim.memory_mb} MiB (address space) exceeded: the program died of MemoryError "
                f"(exit status {code})"))
        return SandboxResult(text, "", code, **common)

    async def arun(self, code: str) -> SandboxResult:
        """:meth:`run` in a thread of the sandbox's own pool (sized for many concurrent calls, so a call
        starts at once and its time limit counts from then), so the event loop keeps going."""
        return await asyncio.get_running_loop().run_in_executor(_executor(), self.run, code)


class _Output:
    """The first and the last ``limit // 2`` bytes of a stream, and how many bytes between them were dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        del self.tail[: max(0, len(self.tail) - (self.limit - self.limit // 2))]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        head = bytes(self.head).decode("utf-8", errors="replace")
        tail = bytes(self.tail).decode("utf-8", errors="replace")
        if not self.dropped:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")
        return f"{head}\n... [{self.dropped} bytes of output dropped] ...\n{tail}"


def _read_status(fd: int) -> tuple[bool, dict | None]:
    """``(setup_ok, report)`` from the supervisor's status pipe (``R`` then a dict literal)."""
    data = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except OSError:  # BlockingIOError: no writer closed it yet (cannot happen once the call is over)
        pass
    if not data.startswith(b"R"):
        return False, None
    try:
        report = ast.literal_eval(data[1:].decode())
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return True, None
    return True, report if isinstance(report, dict) else None


def _close_pipe(fds: list[int]) -> None:
    # each end closed exactly once (a second close could hit another thread's reused fd number)
    for i, fd in enumerate(fds):
        if fd >= 0:
            os.close(fd)
            fds[i] = -1


def _wait_exited(pid: int, deadline: float) -> bool:
    """Wait (without reaping) until child ``pid`` has exited or ``deadline``; whether it exited."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _end_call(proc: subprocess.Popen, cgroup: str | None) -> None:
    """After the call: kill what is left of its process group (while the unreaped leader keeps the group id
    from being reused) and of its cgroup, then reap it."""
    _kill_group(proc.pid)
    if cgroup:
        _kill_cgroup(cgroup)
    if not _wait_exited(proc.pid, time.monotonic() + 10.0):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
        logger.warning("python sandbox: process %d did not end after SIGKILL", proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_pidfd(parent: int) -> int | None:
    """A pidfd of ``parent``'s (only) child, verified to still be its child once opened."""
    for pid in _children_of(parent):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        if pid in _children_of(parent):
            return fd
        os.close(fd)
    return None


def _children_of(parent: int) -> list[int]:
    """Pids whose parent is ``parent`` (``/proc/*/stat``; ``task/*/children`` needs CONFIG_PROC_CHILDREN)."""
    found = []
    want = str(parent).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2:].split()[1] == want:
            found.append(int(name))
    return found


def _new_cgroup() -> str | None:
    base = cgroup_base()
    if base is None:
        return None
    path = os.path.join(base, f"polyrl-sandbox-{os.getpid()}-{next(_CGROUP_IDS)}")
    try:
        os.mkdir(path)
    except OSError as exc:
        logger.debug("python sandbox: cannot create cgroup %s: %s", path, exc)
        return None
    return path


def _kill_cgroup(path: str) -> None:
    """Kill every process in cgroup ``path`` and wait until it is empty."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        return
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(path, "cgroup.events")) as f:
                if "populated 0" in f.read():
                    return
        except OSError:
            return
        time.sleep(0.002)


def _remove_cgroup(path: str) -> None:
    _kill_cgroup(path)
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY for a moment after the last process left
            time.sleep(0.01)
    logger.warning("python sandbox: could not remove cgroup %s", path)
