"""polyrl against verl main's own numbers (``verl_reference.json``, made by ``verl_reference_gen.py``).

The fixture holds fixed random inputs (seeded, stored as numbers) and what verl's
``core_algos`` / ``rollout_corr_helper`` returned for them at commit 1dda039.
Comparisons are on response tokens (polyrl zeroes padding; verl leaves values there
for GAE and whitened estimators).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from polyrl.algorithms import agg_loss, get_adv_estimator_fn, get_policy_loss_fn
from polyrl.algorithms.rollout_correction import compute_rollout_correction_and_rejection_mask

REF = json.loads((Path(__file__).parent / "verl_reference.json").read_text())
INP = {k: (torch.tensor(v, dtype=torch.float32) if k != "index" else v) for k, v in REF["inputs"].items()}
MASK = INP["response_mask"]
VALID = MASK.bool()
ATOL = 2e-5


def close(actual: torch.Tensor, expected: Any, where: torch.Tensor | None = VALID, atol: float = ATOL) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float64)
    actual_t = actual.detach().double()
    if where is not None:
        actual_t, expected_t = actual_t[where], expected_t[where]
    assert torch.allclose(actual_t, expected_t, atol=atol, rtol=1e-5), (actual_t, expected_t)


def test_fixture_documents_its_origin():
    assert REF["verl_commit"].startswith("1dda039")
    assert "verl_reference_gen.py" in REF["generator"] and isinstance(REF["seed"], int)


@pytest.mark.parametrize("key", sorted(REF["agg_loss"]))
def test_agg_loss_matches_verl(key):
    mode, scope = key.split("|")
    kwargs = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12,
              "loss_scale_factor": 16} if scope == "global" else {}
    assert float(agg_loss(INP["advantages"], MASK, mode, **kwargs)) == pytest.approx(REF["agg_loss"][key], abs=1e-5)


def _estimate(key: str) -> tuple[torch.Tensor, torch.Tensor]:
    name, *opts = key.split("|")
    common = {"token_level_rewards": INP["token_level_rewards"], "response_mask": MASK}
    idx = np.array(INP["index"], dtype=object)
    if name == "reinforce_plus_plus":
        return get_adv_estimator_fn(name)(**common, config={"gamma": float(opts[0].split("=")[1])})
    if name == "gae":
        return get_adv_estimator_fn(name)(INP["token_level_rewards"], INP["values"], MASK, 0.95, 0.9)
    if name == "grpo_vectorized":
        return get_adv_estimator_fn(name)(**common, index=idx, norm_adv_by_std_in_grpo=opts[0] == "norm=True")
    if name == "rloo_vectorized":
        return get_adv_estimator_fn(name)(**common, index=idx)
    if name == "gdpo" and opts == ["single"]:
        return get_adv_estimator_fn(name)(**common, index=idx)
    if name == "gdpo":  # verl's spelling: config keys + non_tensor_batch columns
        config = {"gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": [0.5, 2.0]}
        columns = {"format": INP["gdpo_format"].numpy(), "accuracy": INP["gdpo_accuracy"].numpy()}
        return get_adv_estimator_fn(name)(**common, index=idx, config=config, non_tensor_batch=columns)
    use_w, tail = (o.split("=")[1] == "True" for o in opts)
    return get_adv_estimator_fn(name)(**common, index=INP["index"], old_log_probs=INP["old_log_prob"],
                                      sum_pi_squared=INP["sum_pi_squared"],
                                      rollout_is_weights=INP["rollout_is_weights"] if use_w else None,
                                      handle_zero_tail=tail)


@pytest.mark.parametrize("key", sorted(REF["estimators"]))
def test_estimator_matches_verl(key):
    adv, ret = _estimate(key)
    close(adv, REF["estimators"][key]["advantages"])
    close(ret, REF["estimators"][key]["returns"])
    assert torch.all(adv[~VALID] == 0)


def test_gdpo_reward_components_by_name_equal_verls_non_tensor_batch_spelling():
    idx = np.array(INP["index"], dtype=object)
    via_verl = _estimate("gdpo|keys=format,accuracy|weights=0.5,2.0")[0]
    native = get_adv_estimator_fn("gdpo")(INP["token_level_rewards"], MASK, index=idx,
                                          config={"gdpo_reward_weights": [0.5, 2.0]},
                                          reward_components={"format": INP["gdpo_format"],
                                                             "accuracy": INP["gdpo_accuracy"]})[0]
    assert torch.allclose(native, via_verl, atol=1e-6)
    with pytest.raises(ValueError, match="'missing' .*not in the batch"):
        get_adv_estimator_fn("gdpo")(INP["token_level_rewards"], MASK, index=idx,
                                     config={"gdpo_reward_keys": ["missing"]}, non_tensor_batch={"format": [0] * 6})


def _actor(**kw: Any) -> dict[str, Any]:
    return {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0, **kw}


LOSS_CASES = {
    "vanilla|token-mean|is_weights": ("vanilla", _actor(), "token-mean", True, {}),
    "vanilla|seq-mean-token-mean|is_weights": ("vanilla", _actor(), "seq-mean-token-mean", True, {}),
    "vanilla|token-sum|is_weights": ("vanilla", _actor(), "token-sum", True, {}),
    "vanilla|token-mean|global": ("vanilla", _actor(), "token-mean", False,
                                  {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12}),
    "dro|beta=0.5": ("dro", _actor(policy_loss={"dro_beta": 0.5}), "token-mean", False, {}),
    "dro|beta=0.5|seq-mean-token-sum|is_weights": ("dro", _actor(policy_loss={"dro_beta": 0.5}),
                                                   "seq-mean-token-sum", True, {}),
    "dppo_tv|clip=0.05": ("dppo_tv", _actor(clip_ratio=0.05, clip_ratio_c=20.0), "token-mean", False, {}),
    "dppo_tv|low=0.02,high=0.08,c=1.5": ("dppo_tv", _actor(clip_ratio=0.05, clip_ratio_low=0.02,
                                                           clip_ratio_high=0.08, clip_ratio_c=1.5),
                                         "token-mean", False, {}),
    "dppo_kl|clip=0.05": ("dppo_kl", _actor(clip_ratio=0.05, clip_ratio_c=20.0), "token-mean", False, {}),
    "dppo_kl|low=0.02,high=0.08,c=1.5": ("dppo_kl", _actor(clip_ratio=0.05, clip_ratio_low=0.02,
                                                           clip_ratio_high=0.08, clip_ratio_c=1.5),
                                         "token-mean", False, {}),
}
#: verl metric name -> polyrl's (the trainer adds the ``actor/`` prefix)
METRIC_NAMES = {"actor/pg_clipfrac": "pg_clipfrac", "actor/ppo_kl": "ppo_kl", "actor/pg_clipfrac_lower": "pg_clipfrac_lower"}


def _check_loss(ref: dict[str, Any], loss: torch.Tensor, log_prob: torch.Tensor, metrics: dict[str, float]) -> None:
    assert float(loss.detach()) == pytest.approx(ref["loss"], abs=1e-5)
    close(log_prob.grad, ref["grad"], where=None, atol=1e-6)
    for verl_name, value in ref["metrics"].items():
        name = METRIC_NAMES.get(verl_name, verl_name)
        if name in metrics:
            assert metrics[name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.parametrize("key", sorted(LOSS_CASES))
def test_policy_loss_matches_verl(key):
    name, config, mode, use_w, info = LOSS_CASES[key]
    log_prob = INP["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(INP["old_log_prob"], log_prob, INP["advantages"], MASK, mode, config,
                                             rollout_is_weights=INP["rollout_is_weights"] if use_w else None, **info)
    loss.backward()
    _check_loss(REF["policy_losses"][key], loss, log_prob, metrics)


def test_verl_config_global_batch_info_is_read():
    config = _actor(global_batch_info={"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12})
    log_prob = INP["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("vanilla")(INP["old_log_prob"], log_prob, INP["advantages"], MASK,
                                                  "token-mean", config)
    loss.backward()
    _check_loss(REF["policy_losses"]["vanilla|token-mean|global"], loss, log_prob, metrics)


@pytest.mark.parametrize("key", sorted(k for k in REF["policy_losses"] if k.startswith("bypass_mode")))
def test_bypass_mode_matches_verl(key):
    ref = REF["policy_losses"][key]
    log_prob = INP["log_prob"].clone().requires_grad_(True)
    config = _actor(policy_loss={"rollout_correction": ref["config"]})
    loss, metrics = get_policy_loss_fn("bypass_mode")(INP["rollout_log_prob"], log_prob, INP["advantages"], MASK,
                                                      "token-mean", config)
    loss.backward()
    _check_loss(ref, loss, log_prob, metrics)
    shared = [k for k in ref["metrics"] if k.startswith("rollout_corr/") and k in metrics]
    assert len(shared) >= 4, shared
    for k in shared:
        assert metrics[k] == pytest.approx(ref["metrics"][k], rel=1e-4, abs=1e-5), k


@pytest.mark.parametrize("key", sorted(REF["rollout_correction"]))
def test_rollout_correction_matches_verl(key):
    ref = REF["rollout_correction"][key]
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        INP["old_log_prob"], INP["rollout_log_prob"], MASK, **ref["config"])
    if ref["rollout_is_weights"] is None:
        assert weights is None
    else:
        close(weights, ref["rollout_is_weights"], where=None, atol=1e-5)
    assert torch.equal(mask, torch.tensor(ref["response_mask"], dtype=MASK.dtype))
    shared = [k for k in ref["metrics"] if k in metrics]
    assert len(shared) >= 6, shared
    for k in shared:
        assert metrics[k] == pytest.approx(ref["metrics"][k], rel=1e-4, abs=1e-5), k
