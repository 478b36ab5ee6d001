"""``trainer.placement``: which pool (a group of worker processes, one device each) holds each role.

Three spellings, resolved by :func:`resolve_placement` into :class:`Placement`:

* ``colocated`` (default): one pool of ``trainer.n_workers`` holding every role (the hybrid engine);
* ``split``: the rollout in a pool of ``trainer.rollout_workers``, every other role in the actor's pool of
  ``trainer.n_workers``;
* a mapping of roles to pool names, with the pools' sizes in ``trainer.pools``::

      trainer:
        placement: {actor: train, ref: train, rollout: gen, critic: judge, reward_model: judge}
        pools: {train: 2, gen: 1, judge: 1}

  A role the mapping leaves out goes to the actor's pool. A pool without a size takes ``trainer.n_workers``
  when it holds the actor and ``trainer.rollout_workers`` when it holds the rollout; any other pool needs
  its size in ``trainer.pools``.

Every check that needs no process runs here, before Ray or a worker starts; :func:`check_pools_fit` checks the
pools against the cluster once Ray is up. The ``local`` executor puts every role in one pool of one rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError

#: ``trainer.placement`` shorthands.
SHORTHANDS: tuple[str, ...] = ("colocated", "split")


@dataclass(frozen=True)
class Pool:
    """One pool: ``size`` worker processes (one device each) holding ``roles``."""

    name: str
    size: int
    roles: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run's roles."""

    pools: tuple[Pool, ...]
    #: What the user wrote (``colocated``, ``split`` or ``mapping``), for logs.
    spelling: str = "colocated"

    def pool_of(self, role: str) -> Pool:
        """The pool holding ``role``."""
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(f"no pool holds role '{role}'")

    def shares(self, a: str, b: str) -> bool:
        """Whether roles ``a`` and ``b`` sit in the same pool (the same processes)."""
        return self.pool_of(a).name == self.pool_of(b).name

    def size_of(self, role: str) -> int:
        """Worker processes of the pool holding ``role``."""
        return self.pool_of(role).size

    @property
    def total_workers(self) -> int:
        """Worker processes of every pool together (each takes one CPU and one accelerator)."""
        return sum(p.size for p in self.pools)

    def describe(self) -> str:
        """One line: ``pool (size): role, role; ...``."""
        return "; ".join(f"{p.name} ({p.size}): {', '.join(p.roles)}" for p in self.pools)


def placement_value(config: Any) -> Any:
    """``trainer.placement`` as a string or a plain dict."""
    value = config.trainer.placement
    if isinstance(value, Mapping) or hasattr(value, "items"):
        return {str(k): v for k, v in dict(value).items()}
    return value


def is_shorthand(config: Any, name: str) -> bool:
    """Whether ``trainer.placement`` is the shorthand ``name``."""
    return placement_value(config) == name


def resolve_placement(config: Any, roles: Sequence[str], *, known_roles: Iterable[str] = ()) -> Placement:
    """The pools of ``roles`` (the roles this run uses, actor and rollout first) under ``trainer.placement``.

    ``known_roles``: every role a mapping may name (roles this run leaves unused are accepted and ignored).
    Raises :class:`ConfigError` naming the key for an unknown shorthand or role, a pool without a size, a size
    that disagrees with ``trainer.n_workers``, or a ``trainer.pools`` entry no role uses.
    """
    t = config.trainer
    roles = list(dict.fromkeys(roles))
    if "actor" not in roles or "rollout" not in roles:
        raise ValueError("resolve_placement needs the actor and rollout roles")
    if t.executor == "local":
        return Placement((Pool("local", 1, tuple(roles)),), "local")
    value = placement_value(config)
    sizes = {str(k): v for k, v in dict(getattr(t, "pools", None) or {}).items()}
    if isinstance(value, str):
        if value not in SHORTHANDS:
            raise ConfigError(f"trainer.placement={value!r}: choose 'colocated', 'split', or a mapping of roles to "
                              "pool names ({actor: a, rollout: b, ...}; docs/placement.md)")
        if sizes:
            raise ConfigError(f"trainer.pools={sizes} is set but trainer.placement={value!r} names no pools: give "
                              "trainer.placement as a mapping of roles to pools, or drop trainer.pools")
        if value == "colocated":
            return Placement((Pool("colocated", t.n_workers, tuple(roles)),), "colocated")
        rest = tuple(r for r in roles if r != "rollout")
        return Placement((Pool("actor", t.n_workers, rest), Pool("rollout", t.rollout_workers, ("rollout",))), "split")
    return _resolve_mapping(config, value, sizes, roles, set(known_roles) | set(roles))


def _resolve_mapping(config: Any, mapping: dict[str, Any], sizes: dict[str, Any], roles: list[str],
                     known: set[str]) -> Placement:
    t = config.trainer
    for role, pool in mapping.items():
        if role not in known:
            raise ConfigError(f"trainer.placement.{role}: no such role; roles: {', '.join(sorted(known))}")
        if not isinstance(pool, str) or not pool:
            raise ConfigError(f"trainer.placement.{role}={pool!r}: give the name of a pool (a string)")
    if "actor" not in mapping:
        raise ConfigError(f"trainer.placement={mapping} has no pool for the actor: add actor: <pool> "
                          "(roles left out of the mapping go to the actor's pool)")
    where = {role: str(mapping.get(role, mapping["actor"])) for role in roles}
    members: dict[str, list[str]] = {}
    for role in roles:
        members.setdefault(where[role], []).append(role)
    named = {str(p) for p in mapping.values()} | set(members)
    typos = sorted(set(sizes) - named)  # a pool no role names at all (a pool of unused roles is fine)
    if typos:
        raise ConfigError(f"trainer.pools.{typos[0]}: no role is placed in pool '{typos[0]}' (trainer.placement "
                          f"names {', '.join(sorted(named))})")
    pools = []
    for name, held in members.items():
        size = sizes.get(name)
        if "actor" in held:
            if size is not None and int(size) != t.n_workers:
                raise ConfigError(f"trainer.pools.{name}={size} but trainer.n_workers={t.n_workers}: the actor's pool "
                                  f"has trainer.n_workers workers; set both to the same number (or drop "
                                  f"trainer.pools.{name})")
            size = t.n_workers
        elif size is None and "rollout" in held:
            size = t.rollout_workers
        if size is None:
            raise ConfigError(f"trainer.pools has no size for pool '{name}' (holding {', '.join(held)}): add "
                              f"trainer.pools.{name}=N")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"trainer.pools.{name}={size!r}: a pool needs a whole number of workers, 1 or more")
        pools.append(Pool(name, int(size), tuple(held)))
    return Placement(tuple(pools), "mapping")


def needed_resources(placement: Placement, accelerator: str | None) -> dict[str, float]:
    """What the pools ask of the cluster: one CPU and one ``accelerator`` (a Ray resource name) per worker."""
    need = {"CPU": float(placement.total_workers)}
    if accelerator:
        need[accelerator] = float(placement.total_workers)
    return need


def check_pools_fit(placement: Placement, cluster: Mapping[str, float], accelerator: str | None) -> None:
    """Raise :class:`ConfigError` in one line, naming every pool and the cluster's resources, when the pools
    need more CPUs or accelerators than ``cluster`` (``ray.cluster_resources()``) has."""
    need = needed_resources(placement, accelerator)
    short = {k: v for k, v in need.items() if float(cluster.get(k, 0.0)) < v}
    if not short:
        return
    pools = ", ".join(f"{p.name} ({p.size} x {p.roles[0] if len(p.roles) == 1 else '+'.join(p.roles)})"
                      for p in placement.pools)
    wants = ", ".join(f"{v:g} {k}" for k, v in need.items())
    has = ", ".join(f"{float(cluster.get(k, 0.0)):g} {k}" for k in need)
    raise ConfigError(
        f"trainer.placement: the pools do not fit the cluster: {pools} need {wants} (one of each per worker); "
        f"the cluster has {has}. Shrink trainer.pools / trainer.n_workers / trainer.rollout_workers, raise "
        "trainer.ray_num_cpus, or add nodes")
