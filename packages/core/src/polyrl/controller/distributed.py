"""Moved to :mod:`polyrl.distributed` (engines need it; it does not depend on how they are driven).

Kept so that plugins written against 0.1 keep importing ``polyrl.controller.distributed``.
"""

from polyrl.distributed import free_port, init_distributed

__all__ = ["free_port", "init_distributed"]
