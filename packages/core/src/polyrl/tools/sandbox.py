"""A sandbox for untrusted Python: one process per call, OS-enforced limits, no network, no host files.

Each call runs in a fresh child process that

* starts in new Linux namespaces (``unshare``, util-linux): user (the child is "root" only inside it,
  with every capability dropped before the code runs; when the trainer runs as root, the namespace's root
  is the unprivileged ``nobody`` (65534) on the host, never the host's root), network (no interface but a
  down loopback), mount, PID (the call's processes die with it), IPC and UTS;
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
  open files): CPU seconds, address space, processes, open files, file size, no core dumps; the parent
  enforces the wall time (the whole process group is killed) and truncates output.

Where the setup is not permitted (some containers; probed once by running it on ``pass``),
``isolation="namespaces"`` fails every call with a message saying so; a setup failure of one call is
``error="sandbox setup failed: ..."``, a CPU limit hit ``error="CPU time limit of N s exceeded"``.
``isolation="none"`` runs with the limits and the empty environment only, in a scratch directory, which is
*not* a security boundary (see docs/agents.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

#: The sandbox's user on the host when the trainer runs as root: the namespace's root is mapped to this
#: unprivileged uid/gid (``nobody``), never to the host's root.
SANDBOX_UID = 65534

#: Exit status of the sandboxed Python when it got ``SIGXCPU`` (the CPU soft limit); 128 + SIGXCPU.
_CPU_EXIT = 152

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

#: Runs first inside the sandbox: the per-process limits that must be set inside the namespace, a
#: ``SIGXCPU`` handler (Python is PID 1 of its namespace, where an unhandled SIGXCPU is ignored), then
#: tells the parent that the setup worked (one byte on an inherited pipe, closed before the user's code).
_BOOT = """\
import os, resource, signal, sys
signal.signal(signal.SIGXCPU, lambda *_: os._exit({cpu_exit}))
resource.setrlimit(resource.RLIMIT_NPROC, ({nproc}, {nproc}))
resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))
if {ready_fd} >= 0:
    os.write({ready_fd}, b"R")
    os.close({ready_fd})
os.chdir("/scratch")
sys.argv = ["main.py"]
sys.path.insert(0, "/scratch")
with open("/scratch/main.py") as f:
    source = f.read()
try:
    exec(compile(source, "main.py", "exec"), {{"__name__": "__main__"}})
except SystemExit:
    raise
except BaseException as exc:  # the user's traceback, without this file's frame
    import traceback
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""

#: What util-linux 2.38 ``unshare --fork`` prints (and exits 1) when its child was killed by SIGKILL.
_UNSHARE_SIGKILL = "sigprocmask unblock failed"


@dataclass
class SandboxLimits:
    """Limits of one sandboxed call."""

    #: Wall-clock seconds before the call's processes are killed.
    timeout_s: float = 10.0
    #: CPU seconds (``RLIMIT_CPU``).
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
    #: Bytes of stdout + stderr kept; the rest is dropped and the output marked truncated.
    max_output_bytes: int = 16384


@dataclass
class SandboxResult:
    """What a sandboxed call did."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited with status 0 within its limits."""
        return self.error is None and not self.timed_out and self.returncode == 0


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
                detail = (probe.error or f"exit status {probe.returncode}") + (
                    f" (output: {probe.stdout.strip()[-400:]})" if probe.stdout.strip() and not probe.error else "")
                _NS_PROBE = (False, (
                    "this machine does not permit the sandbox's user + network + mount + PID namespaces, tmpfs "
                    "and proc mounts (a container without CAP_SYS_ADMIN or with a masked /proc, "
                    "kernel.unprivileged_userns_clone=0, or an AppArmor / SELinux policy restricting user "
                    f"namespaces); the probe said: {detail}"))
    return _NS_PROBE


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
    """Runs Python source in a fresh, isolated process per call (see the module docstring)."""

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

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as ``main.py`` and return its output; never raises for what the code does."""
        if self.isolation == "namespaces":
            ok, why = namespaces_available()
            if not ok:
                return SandboxResult("", "", None, error=(
                    f"python sandbox unavailable: {why}. Install util-linux / run where namespaces are allowed, "
                    "or set the python tool's isolation: none (limits only, NOT a security boundary)."))
            return self._run_isolated(code)
        scratch = tempfile.mkdtemp(prefix="polyrl-scratch-")
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            cmd = [*self._prlimit(), self.python, "-I", "-S", os.path.join(scratch, "main.py")]
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"}
            return self._communicate(cmd, env, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run_isolated(self, code: str) -> SandboxResult:
        """The namespaced run. The call's work dir (created here, removed in ``finally``; nothing is created
        in the host's ``/tmp`` inside the sandbox) holds the new root's mount point and the program files,
        which the setup copies into a size-limited tmpfs mounted on ``/scratch``."""
        lim = self.limits
        work = tempfile.mkdtemp(prefix="polyrl-sbx-")
        ready_r, ready_w = os.pipe()
        ready = [ready_r, ready_w]
        try:
            os.chmod(work, 0o755)  # reachable (not writable) by the unprivileged sandbox user
            for sub in ("root", "prog", "py", "bin"):
                os.mkdir(os.path.join(work, sub), 0o755)
            with open(os.path.join(work, "prog", "main.py"), "w") as f:
                f.write(code)
            with open(os.path.join(work, "prog", ".polyrl_boot.py"), "w") as f:
                f.write(_BOOT.format(nproc=lim.max_processes, nofile=lim.max_open_files, cpu_exit=_CPU_EXIT,
                                     ready_fd=ready_w))
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
            return self._communicate(cmd, env, work, ready=ready)
        finally:
            # each end closed exactly once (a second close could hit another thread's reused fd number)
            os.close(ready_r)
            if ready[1] >= 0:
                os.close(ready_w)
            shutil.rmtree(work, ignore_errors=True)

    def _communicate(self, cmd: list[str], env: dict[str, str], cwd: str,
                     ready: list[int] | None = None) -> SandboxResult:
        """Run ``cmd``, collect its output within the limits; ``ready`` is the setup-done pipe (read end,
        write end), whose write end this closes (and sets to -1) once the child has it."""
        lim = self.limits
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True, close_fds=True,
                                    pass_fds=(ready[1],) if ready else ())
        except OSError as exc:
            return SandboxResult("", "", None, error=f"python sandbox could not start: {exc}")
        if ready:
            os.close(ready[1])  # only the sandbox holds the write end now (EOF once it is gone)
            ready[1] = -1
        out = bytearray()
        truncated = timed_out = False
        cpu_used = 0.0

        def reap(block: bool) -> bool:
            """Wait for the child ourselves (``wait4``: its CPU time, descendants it reaped included)."""
            nonlocal cpu_used
            if proc.returncode is not None:
                return True
            try:
                pid, status, usage = os.wait4(proc.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                proc.returncode = proc.returncode if proc.returncode is not None else -signal.SIGKILL
                return True
            if pid == 0:
                return False
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_used = usage.ru_utime + usage.ru_stime
            return True

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = lim.timeout_s - (time.monotonic() - start)
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(left, 0.5)):
                    if reap(False):
                        break
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                if len(out) > lim.max_output_bytes:
                    truncated = True
                    break
        finally:
            sel.close()
            if not reap(False):
                if timed_out or truncated:
                    _kill_group(proc)
                # output closed: let it exit within its wall time, then kill it
                deadline = max(start + lim.timeout_s, time.monotonic() + 0.5)
                while not reap(False) and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not reap(False):
                    timed_out = timed_out or not truncated
                    _kill_group(proc)
                    reap(True)
            proc.stdout.close()
        text = bytes(out[: lim.max_output_bytes]).decode("utf-8", errors="replace")
        duration = time.monotonic() - start
        rc = proc.returncode
        setup_ok = True
        if ready:
            try:
                os.set_blocking(ready[0], False)
                setup_ok = os.read(ready[0], 16) == b"R"
            except OSError:  # BlockingIOError: nobody wrote (a process of the call may still hold the pipe)
                setup_ok = False
        error = None
        cpu_limit = f"CPU time limit of {lim.cpu_s} s exceeded"
        if timed_out:
            error = f"timed out after {lim.timeout_s:g}s wall time (killed)"
        elif truncated:
            error = f"output exceeded {lim.max_output_bytes} bytes (the process was stopped)"
        elif not setup_ok:
            error = "sandbox setup failed: " + (text.strip()[-1000:] or f"exit status {rc}")
        elif rc == _CPU_EXIT and ready:
            error = cpu_limit
        elif ready and rc == 1 and _UNSHARE_SIGKILL in text:
            # Python (PID 1 of the namespace) was SIGKILLed: by the CPU hard limit or for memory
            text = "\n".join(line for line in text.splitlines() if _UNSHARE_SIGKILL not in line)
            error = cpu_limit if cpu_used >= lim.cpu_s else "killed by SIGKILL (a resource limit was exceeded)"
            rc = -signal.SIGKILL
        elif rc is not None and rc < 0:
            sig = -rc
            error = {signal.SIGXCPU: cpu_limit,
                     signal.SIGKILL: "killed (a resource limit was exceeded)",
                     signal.SIGXFSZ: f"exceeded the file size limit ({lim.max_file_mb} MiB)"}.get(
                sig, f"killed by signal {signal.Signals(sig).name}")
        return SandboxResult(text, "", None if timed_out else rc, timed_out=timed_out, truncated=truncated,
                             duration_s=duration, error=error, metrics={"cpu_s": cpu_used})

    async def arun(self, code: str) -> SandboxResult:
        """:meth:`run` in a thread of the sandbox's own pool (sized for many concurrent calls, so a call
        starts at once and its time limit counts from then), so the event loop keeps going."""
        return await asyncio.get_running_loop().run_in_executor(_executor(), self.run, code)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
