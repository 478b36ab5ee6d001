"""The single controller's side of HybridFlow: worker groups and the processes they run.

The driver holds the algorithm as plain Python; a :class:`WorkerGroup` holds
``n`` SPMD worker processes (Ray actors, or the driver itself with the ``local``
executor) and offers two calls: :meth:`~WorkerGroup.call_all` (same arguments to
every rank) and :meth:`~WorkerGroup.dispatch` (split a batch by data-parallel
rank, run, concatenate the results).
"""

from polyrl.controller.worker_group import LocalWorkerGroup, RayWorkerGroup, WorkerGroup

__all__ = ["LocalWorkerGroup", "RayWorkerGroup", "WorkerGroup"]
