"""Rollout replicas: a rollout engine that shards one model over ``tp`` devices of one node.

A rollout worker group of ``n`` ranks (one device each) holds ``n / tp`` replicas. Replica ``r`` owns the
consecutive ranks ``r*tp .. r*tp + tp - 1``, which must sit on one node (tensor parallelism needs the fast
intra-node link, and the engine starts its ``tp`` processes itself, on that node). The first rank of a
replica, its *leader*, builds the engine with ``tensor_parallel_size=tp`` and the devices of every rank of
the replica made visible; the other ranks lend their device and build no rollout. The trainer sends each
leader its share of the prompts (:func:`replica_call_args`), and a weight sync reaches the leader, whose
engine forwards the weights to each of its tensor-parallel ranks.

With ``tp=1`` (the default) every rank is its own replica and nothing changes: every rank builds a
rollout and gets its share of prompts, as before replicas existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError


@dataclass(frozen=True)
class Replica:
    """One rollout engine: the worker ranks whose devices it uses, all on ``node``."""

    index: int
    ranks: tuple[int, ...]
    node: str = ""

    @property
    def leader(self) -> int:
        """The rank that builds and drives the engine."""
        return self.ranks[0]

    @property
    def tp(self) -> int:
        """Devices (tensor-parallel ranks) of this replica."""
        return len(self.ranks)


def plan_replicas(n_devices: int, tp: int, nodes: Sequence[str] | None = None, *,
                  key: str = "rollout.tensor_parallel_size") -> list[Replica]:
    """Group ``n_devices`` worker ranks into replicas of ``tp`` consecutive ranks on one node each.

    ``nodes[i]`` is the node of rank ``i`` (``None``: all on one node). Raises :class:`ConfigError` naming
    ``key`` when ``tp`` is not a positive divisor of ``n_devices``, or when the ranks of a replica would
    span nodes (say which ranks and nodes, and what to change).
    """
    if tp < 1:
        raise ConfigError(f"{key}={tp}: a rollout replica needs at least one device")
    if n_devices < 1:
        raise ConfigError(f"{key}={tp}: no rollout devices to place replicas on")
    if n_devices % tp:
        raise ConfigError(
            f"{key}={tp} does not divide the {n_devices} rollout devices (one per rollout worker: "
            "trainer.n_workers when colocated, trainer.rollout_workers when split): choose a tensor-parallel "
            f"size that divides {n_devices}, or a worker count that is a multiple of {tp}")
    if nodes is not None and len(nodes) != n_devices:
        raise ValueError(f"plan_replicas: {len(nodes)} node ids for {n_devices} devices")
    node_of = list(nodes) if nodes is not None else [""] * n_devices
    replicas = []
    for index in range(n_devices // tp):
        ranks = tuple(range(index * tp, (index + 1) * tp))
        where = sorted({node_of[r] for r in ranks})
        if len(where) > 1:
            per_node = {n: node_of.count(n) for n in dict.fromkeys(node_of)}
            raise ConfigError(
                f"{key}={tp}: rollout replica {index} (worker ranks {ranks[0]}-{ranks[-1]}) cannot be placed on one "
                f"node: its ranks landed on nodes {where}. Devices per node: {per_node}. A replica's devices must "
                f"share a node: give every node a multiple of {tp} rollout devices, or lower {key}")
        replicas.append(Replica(index, ranks, where[0]))
    return replicas


def leaders(replicas: Sequence[Replica]) -> list[int]:
    """The leader rank of each replica, in replica order."""
    return [r.leader for r in replicas]


def replica_call_args(rows: Sequence[Any], replicas: Sequence[Replica], world_size: int) -> list[tuple[Any]]:
    """Per-rank arguments that send replica ``r`` the ``r``-th equal share of ``rows`` (through its leader);
    the other ranks of a replica get an empty list. Raises ``ValueError`` when ``rows`` does not split
    evenly over the replicas."""
    count = len(replicas)
    if len(rows) % count:
        raise ValueError(f"{len(rows)} samples do not split evenly over {count} rollout replicas")
    step = len(rows) // count
    args: list[tuple[Any]] = [([],) for _ in range(world_size)]
    for replica in replicas:
        args[replica.leader] = (list(rows[replica.index * step : (replica.index + 1) * step]),)
    return args


def replica_of(rank: int, replicas: Sequence[Replica]) -> Replica:
    """The replica that owns worker ``rank``."""
    for replica in replicas:
        if rank in replica.ranks:
            return replica
    raise ValueError(f"rank {rank} belongs to no rollout replica")
