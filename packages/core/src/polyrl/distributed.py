"""torch.distributed set-up for worker processes: neutral ground that engines and the controller both use.

An engine needs a process group but must not depend on how it is driven (Ray, torchrun, a test), so this
module imports nothing else from polyrl.

A port picked by :func:`free_port` is free when picked, not when used: another process can bind it in
between (about one run in thirty did, on a busy machine). A single process (``world_size == 1``) therefore
retries its rendezvous on a fresh port (:func:`init_distributed`); a group of several processes cannot
agree on a new port by itself, so rank 0 raises :class:`RendezvousPortInUse` and the driver starts the
group again on another port (:class:`polyrl.controller.worker_group.RayWorkerGroup`).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("polyrl")

#: How many fresh ports a single process tries before giving up.
PORT_ATTEMPTS = 5


class RendezvousPortInUse(RuntimeError):
    """Rank 0 could not listen on the rendezvous port: another process took it after it was picked."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or its text, for an error re-raised by Ray) says a rendezvous port was taken."""
    if isinstance(exc, RendezvousPortInUse):
        return True
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower() or "RendezvousPortInUse" in text


def init_distributed(backend: str, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join (or create) the default process group, unless this process already has one.

    With ``world_size == 1`` a taken ``master_port`` is replaced by a fresh free port (up to
    :data:`PORT_ATTEMPTS` times). With more ranks, rank 0 raises :class:`RendezvousPortInUse` so that whoever
    started the group can start it again on another port.
    """
    if dist.is_available() and dist.is_initialized():
        return
    port = master_port
    for attempt in range(PORT_ATTEMPTS):
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)),
        )
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
            return
        except Exception as exc:
            if not port_in_use_error(exc) or rank != 0:
                raise
            if world_size > 1:
                raise RendezvousPortInUse(
                    f"rendezvous port {master_addr}:{port} was taken by another process before rank 0 could listen "
                    "on it (EADDRINUSE); the group must start again on another port") from None
            if attempt == PORT_ATTEMPTS - 1:
                raise RendezvousPortInUse(f"no free rendezvous port on {master_addr} after {PORT_ATTEMPTS} tries "
                                          "(each was taken before it could be used)") from None
            log.info("rendezvous port %d was taken before use; trying another", port)
            port = free_port(master_addr if master_addr not in ("", "0.0.0.0") else "127.0.0.1")


def ensure_process_group(backend: str) -> None:
    """A default process group for an engine built outside a worker group (a test, a notebook, a script):
    a group of one on ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT`` (default a free port).
    Does nothing when this process already has one."""
    if dist.is_initialized():
        return
    init_distributed(backend, 0, 1, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     int(os.environ.get("MASTER_PORT", 0)) or free_port())


def exit_process(code: int = 0) -> None:
    """Leave the process group (if any), flush stdout and stderr, and end the process without the interpreter's
    teardown.

    For scripts that run one rank of a gloo group and then exit (launched by tests, benchmarks or a user's own
    launcher). At interpreter finalization, objects still alive from the group's collectives (gloo work items
    holding tensors) can be destroyed after the runtime they need is gone; rarely (once in this project's
    CI runs) the process then aborts with ``terminate called without an active exception`` and exit status
    -6 after all its work was done and saved. Ending with ``os._exit`` skips that teardown; everything the script
    wrote is already flushed and closed.
    """
    import sys

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to flush
            pass
    os._exit(code)
