"""The single controller's side of HybridFlow: worker groups and the processes they run.

The driver holds the algorithm as plain Python; a :class:`WorkerGroup` holds
``n`` SPMD worker processes (Ray actors, or the driver itself with the ``local``
executor) and offers blocking calls, :meth:`~WorkerGroup.call_all` (same arguments
to every rank) and :meth:`~WorkerGroup.dispatch` (split a batch by data-parallel
rank, run, concatenate the results), and non-blocking ones,
:meth:`~WorkerGroup.call_all_async` and :meth:`~WorkerGroup.call_rank_async`, which
return a :class:`CallHandle` (see :func:`wait_any`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.controller.worker_group import CallHandle, LocalWorkerGroup, RayWorkerGroup, WorkerGroup, wait_any

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "CallHandle": "polyrl.controller.worker_group",
    "LocalWorkerGroup": "polyrl.controller.worker_group",
    "RayWorkerGroup": "polyrl.controller.worker_group",
    "WorkerGroup": "polyrl.controller.worker_group",
    "wait_any": "polyrl.controller.worker_group",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = ["CallHandle", "LocalWorkerGroup", "RayWorkerGroup", "WorkerGroup", "wait_any"]
