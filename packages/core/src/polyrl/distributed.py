"""torch.distributed set-up for worker processes: neutral ground that engines and the controller both use.

An engine needs a process group but must not depend on how it is driven (Ray, torchrun, a test), so this
module imports nothing else from polyrl.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join (or create) the default process group, unless this process already has one."""
    if dist.is_available() and dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)),
    )
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
