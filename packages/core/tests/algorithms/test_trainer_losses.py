"""What the trainer hands a policy loss: verl-style losses run unchanged; rollout correction reaches the loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from polyrl import hookimpl
from polyrl.algorithms import UnknownAlgorithmError, agg_loss, get_adv_estimator_fn, get_policy_loss_fn
from polyrl.algorithms.rollout_correction import rollout_correction_settings
from polyrl.config.schema import ActorConfig
from polyrl.errors import RegistryError
from polyrl.protocols import LossScale
from polyrl.trainer.losses import make_actor_loss

B, R = 4, 5


def verl_style_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                       rollout_is_weights=None):
    """A PPO loss written the way verl main writes one: no loss_scale, config.get and **global_batch_info."""
    clip_ratio = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    loss1 = -advantages * ratio
    clipped = torch.maximum(loss1, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    pg_losses = torch.where(advantages < 0, torch.min(-advantages * clip_ratio_c, clipped), clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    **config.global_batch_info)
    return loss, {"actor/ppo_kl": 0.0}


class VerlStylePlugin:
    @hookimpl
    def register_policy_losses(self, register):
        register("verl_style", verl_style_vanilla)


def _micro_batches(seed: int = 0) -> tuple[list[TensorDict], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(R)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]).float()
    old = -torch.rand(B, R, generator=g) - 0.1
    new = old + 0.3 * torch.randn(B, R, generator=g)
    batch = TensorDict({"response_mask": mask, "advantages": torch.randn(B, R, generator=g), "old_log_probs": old,
                        "rollout_log_probs": old + 0.2 * torch.randn(B, R, generator=g)}, batch_size=[B])
    return [batch[:2], batch[2:]], [new[:2], new[2:]]


def _run(cfg: Any, mbs: list[TensorDict], logps: list[torch.Tensor], on_policy: bool = False,
         ) -> tuple[float, torch.Tensor, dict[str, float]]:
    loss_fn = make_actor_loss(cfg, on_policy=on_policy)
    scale = LossScale(dp_size=1, batch_num_tokens=int(sum(mb["response_mask"].sum() for mb in mbs)),
                      global_batch_size=B)
    total, grads, metrics = 0.0, [], {}
    for mb, logp in zip(mbs, logps, strict=True):
        leaf = logp.clone().requires_grad_(True)
        loss, metrics = loss_fn({"log_probs": leaf}, mb, scale)
        loss.backward()
        total += float(loss.detach())
        grads.append(leaf.grad)
    return total, torch.cat(grads), metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_a_verl_style_loss_registered_through_the_hook_runs_unchanged(polyrl_plugins, mode):
    polyrl_plugins.register(VerlStylePlugin(), "verl-style")
    mbs, logps = _micro_batches()
    cfg = ActorConfig(loss_agg_mode=mode, clip_ratio_high=0.28)
    expected = _run(cfg, mbs, logps)
    cfg.policy_loss.loss_mode = "verl_style"
    got = _run(cfg, mbs, logps)
    # the same numbers as the built-in vanilla loss, global normalisation included (through global_batch_info)
    assert got[0] == pytest.approx(expected[0], abs=1e-6)
    assert torch.allclose(got[1], expected[1], atol=1e-7)
    assert "actor/ppo_kl" in got[2] and "actor/actor/ppo_kl" not in got[2]


def test_rollout_is_weights_in_the_batch_reach_the_loss():
    mbs, logps = _micro_batches(1)
    cfg = ActorConfig()
    plain = _run(cfg, mbs, logps)
    for mb in mbs:
        mb["rollout_is_weights"] = torch.full_like(mb["advantages"], 0.5)
    weighted = _run(cfg, mbs, logps)
    assert weighted[0] == pytest.approx(0.5 * plain[0], abs=1e-6)
    assert torch.allclose(weighted[1], 0.5 * plain[1])


def test_on_policy_update_computes_token_weights_per_micro_batch():
    mbs, logps = _micro_batches(2)
    for mb in mbs:
        del mb["old_log_probs"]
    cfg = ActorConfig()
    cfg.policy_loss.rollout_correction = {"rollout_is": "token", "rollout_is_threshold": 1.1}
    got = _run(cfg, mbs, logps, on_policy=True)
    for mb, logp in zip(mbs, logps, strict=True):
        mb["rollout_is_weights"] = torch.exp(logp - mb["rollout_log_probs"]).clamp(max=1.1) * mb["response_mask"]
    expected = _run(ActorConfig(), mbs, logps, on_policy=True)
    assert got[0] == pytest.approx(expected[0], abs=1e-6)
    assert torch.allclose(got[1], expected[1], atol=1e-7)
    assert "rollout_corr/rollout_is_mean" in got[2]


def test_old_tis_key_is_token_level_truncated_is():
    assert rollout_correction_settings(None, 2.0)["rollout_is"] == "token"
    assert rollout_correction_settings({"rollout_is": "token", "rollout_is_threshold": 2.0}, 2.0) is not None
    with pytest.raises(ValueError, match="disagree"):
        rollout_correction_settings({"rollout_is": "sequence"}, 2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_correction_settings({"rollout_is": "token", "rollout_is_threshold": "2_1"})
    assert rollout_correction_settings({}) is None
    with pytest.raises(ValueError, match="unknown"):
        rollout_correction_settings({"rollout_iss": "token"})


def test_unknown_names_raise_a_value_error_with_polyrls_message():
    for lookup, name in ((get_adv_estimator_fn, "grpoo"), (get_policy_loss_fn, "vanila")):
        with pytest.raises(ValueError, match=name) as info:
            lookup(name)
        assert isinstance(info.value, UnknownAlgorithmError) and isinstance(info.value, RegistryError)
        assert "grpo" in str(info.value) or "vanilla" in str(info.value)  # the registered names are listed


def test_verl_enum_and_module_paths():
    from polyrl.algorithms import AdvantageEstimator, compute_gae_advantage_return
    from polyrl.algorithms import torch_functional as verl_F

    assert get_adv_estimator_fn(AdvantageEstimator.GAE) is compute_gae_advantage_return
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    assert torch.allclose(verl_F.logprobs_from_logits(logits, labels),
                          torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0])
    probs = torch.softmax(logits, -1)
    assert torch.allclose(verl_F.entropy_from_logits(logits), -(probs * probs.log()).sum(-1), atol=1e-6)
    assert torch.allclose(verl_F.calculate_sum_pi_squared_from_logits(logits), probs.square().sum(-1), atol=1e-6)
    assert torch.equal(verl_F.clip_by_value(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor(0.0), torch.tensor(1.0)),
                       torch.tensor([0.0, 0.5, 1.0]))
    assert verl_F.get_response_mask(torch.tensor([[5, 2, 7, 2]]), eos_token=2).tolist() == [[1, 1, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sum_pi_squared_keeps_the_logits_dtype(dtype):
    """verl's calculate_sum_pi_squared_from_logits returns the input's dtype; float64 keeps float64's precision."""
    from polyrl.algorithms import torch_functional as verl_F

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, dtype=torch.float64, generator=gen) * 4).to(dtype)
    out = verl_F.calculate_sum_pi_squared_from_logits(logits)
    assert out.dtype == dtype and out.shape == (3, 5)
    exact = torch.softmax(logits.double(), -1).square().sum(-1)
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # float32: 6e-8 x logsumexp ~ 24
    assert torch.allclose(out.double(), exact, atol=0, rtol=rtol)


def test_kl_loss_ignores_nan_in_padding():
    mbs, logps = _micro_batches(3)
    cfg = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    for mb, logp in zip(mbs, logps, strict=True):
        mb["ref_log_prob"] = logp - 0.05
    clean = _run(cfg, mbs, logps)
    for mb in mbs:
        mb["ref_log_prob"] = torch.where(mb["response_mask"] == 0, torch.nan, mb["ref_log_prob"])
    dirty = _run(cfg, mbs, logps)
    assert dirty[0] == pytest.approx(clean[0], abs=1e-7) and torch.isfinite(dirty[1]).all()
    assert torch.equal(dirty[1], clean[1])


def test_a_loss_is_adapted_once_at_look_up_to_the_protocols_keywords(polyrl_plugins):
    """A verl 0.5 loss (``rollout_log_probs`` only) is wrapped once: the wrapper takes every keyword the trainer
    passes and hands the loss only what it declares; a loss that declares them all comes back as it is."""
    import inspect

    from polyrl.algorithms import POLICY_LOSS_KEYWORDS, as_policy_loss
    from polyrl.algorithms.policy_losses import compute_policy_loss_vanilla

    seen: list[dict] = []

    def verl05(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_log_probs=None):
        seen.append({"rollout_log_probs": rollout_log_probs})
        return (log_prob - old_log_prob).sum(), {}

    class Plugin:
        @hookimpl
        def register_policy_losses(self, register):
            register("verl05", verl05)

    polyrl_plugins.register(Plugin(), "verl05")
    adapted = get_policy_loss_fn("verl05")
    assert adapted is get_policy_loss_fn("verl05") is as_policy_loss(verl05)  # adapted once, then reused
    assert adapted is not verl05 and set(POLICY_LOSS_KEYWORDS) <= set(inspect.signature(adapted).parameters)
    x = torch.zeros(1, 2)
    adapted(x, x, x, x, "token-mean", {}, rollout_log_probs=None, loss_scale=LossScale(), rollout_is_weights=x)
    adapted(x, x, x, x, "token-mean", {}, rollout_log_probs=x + 1, loss_scale=None, rollout_is_weights=None)
    assert seen[0]["rollout_log_probs"] is None and torch.equal(seen[1]["rollout_log_probs"], x + 1)
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla  # declares them all: no wrapper


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_metrics_are_each_micro_batchs_own_values_not_their_shares(mode):
    """The engines average their micro-batches' metrics: a loss term reported as its share of the mini-batch
    (what the loss returns for the gradient) would read about ``1 / n`` of itself with ``n`` micro-batches."""
    mbs, logps = _micro_batches(3)
    g = torch.Generator().manual_seed(7)
    entropies = [torch.rand(mb["response_mask"].shape, generator=g) for mb in mbs]
    cfg = ActorConfig(loss_agg_mode=mode)
    loss_fn = make_actor_loss(cfg)
    scale = LossScale(dp_size=1, batch_num_tokens=int(sum(mb["response_mask"].sum() for mb in mbs)),
                      global_batch_size=B)
    vanilla = get_policy_loss_fn("vanilla")
    for mb, logp, ent in zip(mbs, logps, entropies, strict=True):
        loss, metrics = loss_fn({"log_probs": logp, "entropy": ent}, mb, scale)
        own_pg, _ = vanilla(mb["old_log_probs"], logp, mb["advantages"], mb["response_mask"], mode, cfg)
        assert metrics["actor/pg_loss"] == pytest.approx(float(own_pg), rel=1e-5)
        assert float(loss) != pytest.approx(float(own_pg), rel=1e-2)  # the loss is the share, the metric is not
        assert metrics["actor/entropy"] == pytest.approx(float(agg_loss(ent, mb["response_mask"], mode)), rel=1e-5)
