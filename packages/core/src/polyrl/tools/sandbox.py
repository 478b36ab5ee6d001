"""A sandbox for untrusted Python: one process per call, OS-enforced limits, no network, no host files.

Each call runs in a fresh child process that

* starts in new Linux namespaces (``unshare``, util-linux): user (the child is "root" only inside it,
  with every capability dropped before the code runs), network (no interface but a
  down loopback), mount, PID (the call's processes die with it), IPC and UTS;
* sees a new root filesystem: a small read-only tmpfs holding read-only bind mounts of ``/usr``,
  ``/lib*``, ``/bin``, ``/sbin``, ``/etc`` and the Python installation, ``/dev/null``/``/dev/urandom``,
  its own ``/proc``, and ``/scratch`` (a fresh directory, the only writable place, deleted after the call).
  The trainer's working tree, run directory, home, ``/tmp`` and virtualenv are not mounted;
* drops every capability (``setpriv --bounding-set=-all --no-new-privs``) before the code runs, so it
  cannot undo those mounts;
* runs ``python -I -S`` (the standard library only, no site-packages) with an empty environment
  (``PATH``, ``HOME=/scratch`` and ``LANG`` only);
* under resource limits (``setrlimit``: ``prlimit`` on the child, and inside the namespace for processes and
  open files): CPU seconds, address space, processes, open files, file size, no core dumps; the parent
  enforces the wall time (the whole process group is killed) and truncates output.

Where namespaces are not permitted (some containers), ``isolation="namespaces"`` fails every call with a
message saying so; ``isolation="none"`` runs with the limits and the empty environment only, in a
scratch directory, which is *not* a security boundary (see docs/agents.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

#: Builds the new root inside the namespaces, then drops capabilities and starts Python.
#: Arguments: $1 scratch dir (host path), $2 python prefix (host path), $3 python executable.
_SETUP = r"""
set -e
R=$(mktemp -d /tmp/polyrl-sbx-root.XXXXXX)
mount -t tmpfs -o size=4m,mode=755 tmpfs "$R"
for d in /usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc "$2"; do
  [ -e "$d" ] || continue
  if [ -L "$d" ]; then mkdir -p "$R$(dirname "$d")"; ln -s "$(readlink "$d")" "$R$d"; continue; fi
  mkdir -p "$R$d"
  mount --rbind "$d" "$R$d"
  mount -o remount,bind,ro,nosuid,nodev "$R$d"
done
mkdir -p "$R/scratch" "$R/dev" "$R/proc" "$R/tmp" "$R/.oldroot"
mount --bind "$1" "$R/scratch"
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

#: Runs first inside the sandbox: the per-process limits that must be set inside the namespace.
_BOOT = """\
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NPROC, ({nproc}, {nproc}))
resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))
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


_NS_OK: bool | None = None


def namespaces_available() -> tuple[bool, str]:
    """Whether this machine lets the sandbox create its namespaces (checked once per process)."""
    global _NS_OK
    if any(shutil.which(p) is None for p in ("unshare", "setpriv", "pivot_root", "prlimit")):
        return False, "the 'unshare', 'setpriv', 'pivot_root' and 'prlimit' programs (util-linux) are not installed"
    if _NS_OK is None:
        try:
            probe = subprocess.run(
                # mounting proves the namespace really grants capabilities (Ubuntu's AppArmor userns
                # restriction lets unshare succeed but not mount)
                ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "/bin/sh", "-c",
                 "mount -t tmpfs -o size=1k tmpfs /tmp && pivot_root --version >/dev/null"],
                capture_output=True, timeout=10, start_new_session=True)
            _NS_OK = probe.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _NS_OK = False
    if not _NS_OK:
        return False, ("this machine does not permit unprivileged user + network + mount + PID namespaces "
                       "(a container without CAP_SYS_ADMIN, kernel.unprivileged_userns_clone=0, or an AppArmor / "
                       "SELinux policy restricting user namespaces)")
    return True, ""


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
        lim = self.limits
        if self.isolation == "namespaces":
            ok, why = namespaces_available()
            if not ok:
                return SandboxResult("", "", None, error=(
                    f"python sandbox unavailable: {why}. Install util-linux / run where namespaces are allowed, "
                    "or set the python tool's isolation: none (limits only, NOT a security boundary)."))
        scratch = tempfile.mkdtemp(prefix="polyrl-scratch-")
        try:
            with open(os.path.join(scratch, "main.py"), "w") as f:
                f.write(code)
            with open(os.path.join(scratch, ".polyrl_boot.py"), "w") as f:
                f.write(_BOOT.format(nproc=lim.max_processes, nofile=lim.max_open_files))
            if self.isolation == "namespaces":
                cmd = [*self._prlimit(), "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid",
                       "--ipc", "--uts", "--fork", "--kill-child", "/bin/sh", "-c", _SETUP, "polyrl-sandbox", scratch,
                       self.prefix, self.python]
                env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
            else:
                cmd = [*self._prlimit(), self.python, "-I", "-S", os.path.join(scratch, "main.py")]
                env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"}
            return self._communicate(cmd, env, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _communicate(self, cmd: list[str], env: dict[str, str], cwd: str) -> SandboxResult:
        lim = self.limits
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True, close_fds=True)
        except OSError as exc:
            return SandboxResult("", "", None, error=f"python sandbox could not start: {exc}")
        out = bytearray()
        truncated = timed_out = False
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = lim.timeout_s - (time.monotonic() - start)
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(left, 0.5)):
                    if proc.poll() is not None:
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
            if proc.poll() is None:
                _kill_group(proc)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
            proc.stdout.close()
        text = bytes(out[: lim.max_output_bytes]).decode("utf-8", errors="replace")
        duration = time.monotonic() - start
        rc = proc.returncode
        error = None
        if timed_out:
            error = f"timed out after {lim.timeout_s:g}s wall time (killed)"
        elif truncated:
            error = f"output exceeded {lim.max_output_bytes} bytes (the process was stopped)"
        elif rc is not None and rc < 0:
            sig = -rc
            error = {signal.SIGXCPU: f"exceeded the CPU limit ({lim.cpu_s}s)",
                     signal.SIGKILL: "killed (a resource limit was exceeded)",
                     signal.SIGXFSZ: f"exceeded the file size limit ({lim.max_file_mb} MiB)"}.get(
                sig, f"killed by signal {signal.Signals(sig).name}")
        return SandboxResult(text, "", None if timed_out else rc, timed_out=timed_out, truncated=truncated,
                             duration_s=duration, error=error)

    async def arun(self, code: str) -> SandboxResult:
        """:meth:`run` in a worker thread, so the event loop (other agent loops) keeps going."""
        return await asyncio.to_thread(self.run, code)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
