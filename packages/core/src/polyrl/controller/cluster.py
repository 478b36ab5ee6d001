"""What a run over several Ray nodes needs: the cluster's address, the manifest checked on every node, and
the torch.distributed rendezvous on the node of a group's first rank.

A single local Ray (what ``polyrl train`` starts by itself) keeps everything on loopback: the worker
groups meet at ``127.0.0.1`` on a port found by the driver, and no node check runs (the workers run the
driver's own interpreter). Joining a cluster (``trainer.ray_address`` or ``RAY_ADDRESS``) changes two
things: before any worker starts, a small Ray task on every alive node rebuilds the run's plugin manager
from the manifest (:func:`check_manifest_on_nodes`), so that a node missing a plugin fails at once with
its name and the ``pip install`` line, not half-way through building a worker group; and a group whose
ranks span nodes meets at its rank 0's node address, on a port that was free on that node
(:func:`rendezvous_address`). See docs/cluster.md.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from polyrl.errors import ManifestError
from polyrl.manifest import Manifest

logger = logging.getLogger(__name__)

#: Placement-group strategies Ray offers (``trainer.placement_strategy``).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def cluster_address(config: Any) -> str:
    """The Ray cluster this run joins: ``trainer.ray_address``, else ``RAY_ADDRESS`` ('' = start a local Ray)."""
    return (getattr(config.trainer, "ray_address", "") or os.environ.get("RAY_ADDRESS", "")).strip()


#: Seconds the driver tries to reach a cluster's address before it says nobody answers there.
CONNECT_TIMEOUT_S = 15.0


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`~polyrl.errors.ConfigError` (one line) unless something accepts a TCP connection at the
    cluster ``address`` (``host:port``, ``ray://host:port`` or ``auto``) within ``timeout_s``: ``ray.init`` itself
    retries an address nobody answers for minutes."""
    from polyrl.errors import ConfigError

    key = "trainer.ray_address (or RAY_ADDRESS)"
    target = address
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            target = canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError:
            raise ConfigError(f"{key}=auto: no Ray cluster runs on this machine (start one with `ray start --head`, "
                              "or give the head's host:port)") from None
    hostport = target.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host:
        host, port = hostport, "10001" if target.startswith("ray://") else "6379"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConfigError(f"{key}={address}: nobody answers at {host}:{port} ({why} after at most {timeout_s:g} s). "
                          "Start the cluster there (`ray start --head --port=...`, docs/cluster.md), or fix the "
                          "address") from None


#: (Ray job, manifest) pairs whose nodes were checked: a run with several worker groups checks once.
_checked: set[tuple[str, Manifest | None]] = set()


def node_answers(node_id: str, timeout_s: float) -> bool:
    """Whether a small task runs on node ``node_id`` within ``timeout_s`` (Ray lists a node that died as alive
    until its health checks fail, tens of seconds later)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ref = ray.remote(lambda: True).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    try:
        return bool(ray.get(ref, timeout=timeout_s))
    except Exception:
        ray.cancel(ref, force=True)
        return False


def alive_resources(gone: set[str]) -> tuple[dict[str, float], int]:
    """The summed resources of the nodes Ray lists as alive, less those in ``gone``; and how many nodes that is."""
    import ray

    total: dict[str, float] = {}
    count = 0
    for node in ray.nodes():
        if node.get("Alive") and node.get("NodeID") not in gone:
            count += 1
            for key, value in (node.get("Resources") or {}).items():
                total[key] = total.get(key, 0.0) + float(value)
    return total, count


def prepare_cluster(config: Any, manifest: Manifest | None) -> str:
    """Before a worker group starts on Ray: check ``trainer.placement_strategy`` (returned, upper-cased)
    and, on a cluster joined by address or with more than one node, the manifest on every node (once per
    Ray job and manifest)."""
    import ray

    from polyrl.errors import ConfigError

    strategy = str(getattr(config.trainer, "placement_strategy", "") or "PACK").upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"config key 'trainer.placement_strategy': {strategy!r} is not a Ray placement "
                          f"strategy; choose one of {', '.join(PLACEMENT_STRATEGIES)}")
    key = (ray.get_runtime_context().get_job_id(), manifest)
    if key not in _checked and (cluster_address(config) or sum(1 for n in ray.nodes() if n.get("Alive")) > 1):
        from polyrl.plugins import get_plugin_manager

        check_manifest_on_nodes(manifest, get_plugin_manager())
        _checked.add(key)
    return strategy


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_endpoint(loopback: bool) -> tuple[str, int]:
    """Runs on the node of a group's rank 0: its address (loopback when every rank is on this node) and
    a port free there a moment ago."""
    import ray

    if loopback:
        return "127.0.0.1", _free_port("127.0.0.1")
    return ray.util.get_node_ip_address(), _free_port("")


def rendezvous_address(node_ids: Sequence[str]) -> tuple[str, int]:
    """Where the ranks of a group on ``node_ids`` (the Ray node id of each rank) meet: ``(address, port)``.

    All ranks on the driver's node: loopback and a port free here (a local run). Otherwise the address is
    found on rank 0's node by a small Ray task: loopback again when all ranks share that node, else the
    node's IP as Ray knows it, with a port free on all of that node's interfaces.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    first = node_ids[0] if node_ids else ""
    one_node = len(set(node_ids)) <= 1
    if not first or (one_node and first == ray.get_runtime_context().get_node_id()):
        return "127.0.0.1", _free_port("127.0.0.1")
    task = ray.remote(_node_endpoint).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(first, soft=False))
    address, port = ray.get(task.remote(one_node), timeout=300)
    logger.info("rendezvous of %d ranks over %d node(s) at %s:%d", len(node_ids), len(set(node_ids)), address, port)
    return address, port


def _node_report(manifest: Manifest | None) -> dict[str, Any]:
    """Runs on one node: load the run's plugins as a worker there would, and say what loaded (or why not)."""
    import ray

    from polyrl.plugins import PluginManager

    where = {"node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname()}
    try:
        pm = PluginManager(manifest)
    except Exception as exc:  # reported to the driver, which raises with the node's name
        return {**where, "error": f"{type(exc).__name__}: {exc}"}
    plugins = {p["name"]: (p["distribution"], p["version"]) for p in pm.describe()}
    return {**where, "error": None, "plugins": plugins}


def check_manifest_on_nodes(manifest: Manifest | None, plugins: Any) -> None:
    """Load the run's plugins on every alive node of the Ray cluster this process is connected to, and
    raise :class:`~polyrl.errors.ManifestError` naming each node where that fails or loads something
    other than the driver (``plugins``: the driver's plugin manager), with the ``pip install`` line."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(_node_report)
    refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(manifest) for n in nodes]
    reports = []
    for node, ref in zip(nodes, refs, strict=True):
        try:
            reports.append(ray.get(ref, timeout=600))
        except ray.exceptions.TaskUnschedulableError:  # the node died since Ray listed it: it runs no worker
            logger.warning("node %s left the cluster during the manifest check; not checked", node.get("NodeName"))
            reports.append(None)
    driver = {p["name"]: (p["distribution"], p["version"]) for p in plugins.describe()}
    problems = []
    for node, report in zip(nodes, reports, strict=True):
        if report is None:
            continue
        name = node.get("NodeName") or report["hostname"]
        label = f"node {name} (ip {report['node_ip']}, host {report['hostname']}, Ray node id {node['NodeID'][:12]})"
        if report["error"] is not None:
            failing = [d for d, _ in driver.values() if d and d != "polyrl" and d in report["error"]]
            problems.append(f"{label}: the run's plugins do not load there: {report['error']}\n"
                            f"  Install them on that node: {_pip_line(driver, failing)}")
            continue
        missing = {k: v for k, v in driver.items() if k not in report["plugins"]}
        differ = {k: (v, report["plugins"][k][1]) for k, v in driver.items()
                  if k in report["plugins"] and report["plugins"][k][1] != v[1]}
        if missing or differ:
            what = [f"plugin '{k}' ({d or 'no distribution'}) is missing" for k, (d, _) in missing.items()]
            what += [f"plugin '{k}' is {d} {there} there but {here} on the driver"
                     for k, ((d, here), there) in differ.items()]
            problems.append(f"{label}: {'; '.join(what)}.\n  Install the driver's versions there: "
                            f"{_pip_line(driver, [driver[k][0] for k in (*missing, *differ)])}")
    if problems:
        raise ManifestError(
            f"manifest {getattr(manifest, 'source', None) or '<none: every installed plugin>'}: "
            f"{len(problems)} of {len(nodes)} Ray node(s) cannot run this run's workers:\n" + "\n".join(problems)
            + "\nEvery node of the cluster needs the same plugins as the driver (docs/cluster.md).")
    logger.info("manifest checked on %d Ray node(s)", len(nodes))


def _pip_line(driver: dict[str, tuple[str | None, str | None]], distributions: Sequence[str | None]) -> str:
    """``pip install 'dist==version' ...`` for ``distributions`` (default: every plugin distribution of the
    driver, the core included), pinned to the driver's versions."""
    versions = {d: v for d, v in driver.values() if d}
    wanted = [d for d in dict.fromkeys(distributions) if d] or sorted(versions)
    return "pip install " + " ".join(f"'{d}=={versions[d]}'" if versions.get(d) else f"'{d}'" for d in wanted)


__all__ = ["PLACEMENT_STRATEGIES", "alive_resources", "check_manifest_on_nodes", "check_reachable", "cluster_address",
           "node_answers", "prepare_cluster", "rendezvous_address"]
