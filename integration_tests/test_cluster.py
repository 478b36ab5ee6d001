"""Runs on a Ray cluster of two nodes (``ray.cluster_utils.Cluster`` on this machine, one CPU each)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from polyrl.errors import ManifestError
from polyrl.trainer.commands import train

#: A plugin whose import fails on a node started with POLYRL_PROBE_BROKEN set (as if a dependency were absent
#: there): every node has the distribution on its path, only node-b cannot load it.
PROBE_HOOKS = (
    "import os\n"
    "if os.environ.get('POLYRL_PROBE_BROKEN'):\n"
    "    raise ModuleNotFoundError(\"No module named 'probe_backend'\", name='probe_backend')\n"
    "from polyrl import hookimpl\n"
    "@hookimpl\n"
    "def register_reward_functions(register):\n"
    "    register('cluster_probe', 'json:dumps')\n"
)


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    info = site / "polyrl_cluster_probe-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: polyrl-cluster-probe\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text("[polyrl]\ncluster-probe = cluster_probe_hooks\n")
    (site / "cluster_probe_hooks.py").write_text(PROBE_HOOKS)
    return site


@pytest.fixture(scope="module")
def two_nodes(probe_site):
    """A head node and ``node-b``, one CPU each; the driver is not connected (``polyrl train`` joins)."""
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="polyrl-cl-", dir="/tmp")  # Ray's socket paths must stay short
    env = {"PYTHONPATH": str(probe_site), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": temp, "env_vars": env,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, node_name="node-b", env_vars={**env, "POLYRL_PROBE_BROKEN": "1"})
    try:
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "critic/score/mean" in r]


def test_actor_over_two_nodes_trains_like_one_node(two_nodes, base_overrides, manifest_file, tmp_path, monkeypatch):
    """Two actor ranks that cannot share a node (one CPU each) meet at rank 0's node address, bind their
    node-local device index, and train step for step like the same two ranks on one local Ray."""
    common = [o for o in base_overrides if not o.startswith("trainer.run_dir=")] + [
        "trainer.executor=ray", "trainer.n_workers=2", "trainer.test_freq=0", "trainer.val_before_train=false"]
    train(manifest_file, [], common + ["trainer.ray_num_cpus=2", f"trainer.run_dir={tmp_path / 'one'}"])
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)  # joined through the environment, as `ray job` does
    train(manifest_file, [], common + [f"trainer.run_dir={tmp_path / 'two'}"])
    log = (tmp_path / "two" / "train.log").read_text()
    assert "rendezvous of 2 ranks over 2 node(s)" in log and "manifest checked on 2 Ray node(s)" in log
    assert "at 127.0.0.1:" not in log.split("rendezvous of 2 ranks", 1)[1].splitlines()[0]
    one, two = _train_rows(tmp_path / "one"), _train_rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_node_missing_a_plugin_fails_naming_the_node(two_nodes, base_overrides, probe_site, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(probe_site))  # the driver has the plugin
    manifest = tmp_path / "probe.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2", "polyrl-cluster-probe>=1.0"]\n')
    with pytest.raises(ManifestError) as info:
        train(manifest, [], base_overrides + ["trainer.executor=ray", f"trainer.ray_address={two_nodes.address}"])
    message = str(info.value)
    assert "1 of 2 Ray node(s)" in message and "node node-b (ip " in message
    assert "probe_backend" in message and "pip install 'polyrl-cluster-probe==1.0.0'" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before any worker started
    import ray

    assert not ray.is_initialized()  # the driver left the cluster it joined
