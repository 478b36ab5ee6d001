"""``trainer.placement`` as a mapping of roles to pools, end to end on a real local Ray: every pool its own
placement group of workers, weights synced from the actor's pool to the rollout's, the critic trained and
checkpointed in a pool of its own; pools that do not fit the cluster stop the run before any worker starts."""

from __future__ import annotations

import json

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train

PLACEMENT = "trainer.placement={actor: train, rollout: gen, critic: value}"


def test_ppo_with_the_actor_the_rollout_and_the_critic_in_pools_of_their_own(base_overrides, manifest_file, tmp_path):
    train(manifest_file, [], base_overrides + [
        "trainer.executor=ray", PLACEMENT, "trainer.pools={value: 1}", "trainer.n_workers=1",
        "trainer.ray_num_cpus=3", "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
        "critic.optim.lr=1e-3", "critic.micro_batch_size=8", "critic.ppo_mini_batch_size=2", "trainer.save_freq=2",
        "trainer.test_freq=0", "trainer.val_before_train=false"])
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["critic/vf_loss"] > 0 and "actor/kl_ref" in r
        # the rollout in its own pool samples from the synced actor: its log-probs match the actor's
        assert r["rollout/logprob_diff_mean"] < 1e-4
    log = (run / "train.log").read_text()
    assert "placement (mapping): train (1): actor, ref; gen (1): rollout; value (1): critic" in log
    step = run / "checkpoints" / "step_2"
    assert (step / "actor" / "meta.json").exists() and (step / "critic" / "meta.json").exists()


def test_pools_that_do_not_fit_the_cluster_stop_the_run_at_start_up(base_overrides, manifest_file, tmp_path):
    with pytest.raises(ConfigError) as err:
        train(manifest_file, [], base_overrides + [
            "trainer.executor=ray", "trainer.placement={actor: train, rollout: gen}", "trainer.pools={gen: 2}",
            "trainer.n_workers=1", "trainer.ray_num_cpus=2"])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("trainer.placement: the pools do not fit the cluster: train (1 x actor), gen (2 x rollout) "
                          "need 3 CPU")
    assert "the cluster has 2 CPU" in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
