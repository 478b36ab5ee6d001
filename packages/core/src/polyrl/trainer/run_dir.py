"""The run directory: created (or refused) before any worker starts, and locked while a run writes to it.

A run holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.polyrl.lock``, a file that names the holder (pid,
host, start time). A second run into the same directory is refused with the holder's pid and host. The
kernel drops the lock when its process exits, however it exits (SIGKILL included), so a lock file left by a
dead run never blocks the next one.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from polyrl.errors import ConfigError

LOCK_FILE = ".polyrl.lock"


class RunDirLockedError(ConfigError):
    """Another live run holds the run directory's lock."""


def prepare_run_dir(path: str | Path, key: str = "trainer.run_dir") -> Path:
    """Create ``path`` (and parents) and check that it is writable; ``ConfigError`` naming ``key`` otherwise."""
    run_dir = Path(path).expanduser().resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{key}={path}: {run_dir} exists and is not a directory; choose another {key}") from None
    except OSError as exc:
        raise ConfigError(f"{key}={path}: cannot create {run_dir} ({exc.strerror or exc}); choose a writable "
                          f"{key}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {run_dir} is not writable; choose a writable {key}")
    return run_dir


class RunDirLock:
    """An exclusive lock on a run directory, held from :meth:`acquire` until :meth:`release` or process exit."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise :class:`RunDirLockedError` naming the live holder."""
        import fcntl

        f = open(self.path, "a+")  # noqa: SIM115 - held open for as long as the lock
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                f.close()  # not "held by another run": this filesystem cannot lock (some FUSE, NFS, Lustre mounts)
                raise ConfigError(
                    f"trainer.run_dir: cannot lock {self.path} ({exc.strerror or exc}); this filesystem does not "
                    "support file locks. Choose a trainer.run_dir on a local filesystem.") from None
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            raise RunDirLockedError(
                f"run directory {self.path.parent} is in use by another polyrl run (pid {holder.get('pid', '?')} on "
                f"host {holder.get('host', '?')}, since {holder.get('started', '?')}). Wait for it to finish, stop "
                "it, or choose another trainer.run_dir."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._file is not None:
            import fcntl

            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        return {}
