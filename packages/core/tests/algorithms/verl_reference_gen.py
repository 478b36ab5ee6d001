"""Generate verl_reference.json: verl main's own numbers for polyrl's parity tests (test_verl_parity.py).

This script is run against verl, never against polyrl, and is not collected by pytest.
verl commit: verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22).
How it was run (outside the repo, with polyrl's .venv python; torch 2.13.0 CPU):

    mkdir -p /tmp/verlref/pkg/verl/{utils,trainer/ppo,trainer/config,workers/config}
    # from a verl checkout at that commit, unchanged:
    #   verl/trainer/ppo/core_algos.py, verl/trainer/ppo/rollout_corr_helper.py,
    #   verl/utils/torch_functional.py, verl/utils/groupwise.py
    # stubs for the verl imports those files need but these functions do not use:
    #   verl/utils/__init__.py (re-exports groupwise's as_torch_index, group_mean_std),
    #   verl/utils/device.py (get_device_name -> "cpu"), verl/utils/import_utils.py (deprecated -> identity),
    #   verl/trainer/config (AlgoConfig, RolloutCorrectionConfig: dicts with attribute access),
    #   verl/workers/config (ActorConfig, PolicyLossConfig: dicts with attribute access),
    #   verl/protocol.py (DataProto holding a dict in .batch)
    cd /tmp/verlref && PYTHONPATH=/tmp/verlref/pkg OMP_NUM_THREADS=1 python verl_reference_gen.py verl_reference.json

Inputs come from torch.Generator().manual_seed(SEED) and are stored in the JSON, so the
tests do not depend on torch's random streams.
"""

import json
import sys

import numpy as np
import torch
import verl.trainer.ppo.core_algos as C
import verl.trainer.ppo.rollout_corr_helper as H
from verl.trainer.config import AlgoConfig
from verl.workers.config import ActorConfig, PolicyLossConfig

SEED = 20260822
B, R = 6, 7
g = torch.Generator().manual_seed(SEED)


def t(x: torch.Tensor) -> list:
    return x.detach().double().tolist()


lengths = torch.tensor([7, 3, 5, 1, 6, 4])
mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
# a multi-turn row: tool tokens (mask 0) between two assistant turns
mask[4] = torch.tensor([1, 1, 0, 0, 1, 1, 0.0])
rewards = torch.zeros(B, R)
last = torch.tensor([6, 2, 4, 0, 5, 3])
rewards[torch.arange(B), last] = torch.randint(0, 3, (B,), generator=g).float() - 0.5
index = ["a", "a", "a", "b", "b", "b"]
values = torch.randn(B, R, generator=g)
old_log_prob = -torch.rand(B, R, generator=g) * 2 - 0.05
log_prob = old_log_prob + torch.randn(B, R, generator=g) * 0.3
advantages = torch.randn(B, R, generator=g)
rollout_log_prob = old_log_prob + torch.randn(B, R, generator=g) * 0.2
sum_pi_squared = torch.rand(B, R, generator=g) * 0.5 + 0.1
is_weights = (torch.rand(B, R, generator=g) * 1.5 + 0.25)
comp_a = torch.randint(0, 2, (B,), generator=g).float()
comp_b = torch.rand(B, generator=g)

out = {
    "verl_commit": "1dda039b9c6311889a9c9a26040677e1254814f9",
    "generator": __doc__.strip(),
    "seed": SEED,
    "inputs": {
        "response_mask": t(mask), "token_level_rewards": t(rewards), "index": index, "values": t(values),
        "old_log_prob": t(old_log_prob), "log_prob": t(log_prob), "advantages": t(advantages),
        "rollout_log_prob": t(rollout_log_prob), "sum_pi_squared": t(sum_pi_squared),
        "rollout_is_weights": t(is_weights), "gdpo_format": t(comp_a), "gdpo_accuracy": t(comp_b),
    },
}
idx = np.array(index, dtype=object)

# ---------------------------------------------------------------- agg_loss
loss_mat = advantages * 1.0
agg = {}
for mode in ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
    agg[f"{mode}|local"] = float(C.agg_loss(loss_mat, mask, mode))
    agg[f"{mode}|global"] = float(C.agg_loss(loss_mat, mask, mode, dp_size=2, batch_num_tokens=40,
                                             global_batch_size=12, loss_scale_factor=16))
out["agg_loss"] = agg

# ---------------------------------------------------------------- estimators
est = {}
for gamma in (1.0, 0.9):
    a, r = C.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=AlgoConfig(gamma=gamma))
    est[f"reinforce_plus_plus|gamma={gamma}"] = {"advantages": t(a), "returns": t(r)}
a, r = C.compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9)
est["gae|gamma=0.95,lam=0.9"] = {"advantages": t(a), "returns": t(r)}
for norm in (True, False):
    a, r = C.compute_grpo_vectorized_outcome_advantage(rewards, mask, idx, norm_adv_by_std_in_grpo=norm)
    est[f"grpo_vectorized|norm={norm}"] = {"advantages": t(a), "returns": t(r)}
a, r = C.compute_rloo_vectorized_outcome_advantage(rewards, mask, idx)
est["rloo_vectorized"] = {"advantages": t(a), "returns": t(r)}
a, r = C.compute_gdpo_outcome_advantage(rewards, mask, idx)
est["gdpo|single"] = {"advantages": t(a), "returns": t(r)}
# gdpo with two reward components read from the batch (scores on the last valid token)
prompt_len = 2
attn = torch.cat([torch.ones(B, prompt_len, dtype=torch.long), (torch.arange(R)[None, :] < (last + 1)[:, None]).long()], dim=1)
batch = {"prompts": torch.zeros(B, prompt_len), "attention_mask": attn}
ntb = {"format": comp_a.numpy(), "accuracy": comp_b.numpy()}
cfg = AlgoConfig(gdpo_reward_keys=["format", "accuracy"], gdpo_reward_weights=[0.5, 2.0])
a, r = C.compute_gdpo_outcome_advantage(rewards, mask, idx, config=cfg, non_tensor_batch=ntb, batch=batch)
est["gdpo|keys=format,accuracy|weights=0.5,2.0"] = {"advantages": t(a), "returns": t(r)}
for name, fn in [("optimal_token_baseline", C.compute_optimal_token_baseline_advantage),
                 ("tir_optimal_token_baseline", C.compute_multi_turn_optimal_token_baseline_advantage)]:
    for use_w in (False, True):
        for tail in (True, False):
            a, r = fn(rewards, mask, index, old_log_prob, sum_pi_squared,
                      rollout_is_weights=is_weights if use_w else None, handle_zero_tail=tail)
            est[f"{name}|is_weights={use_w}|zero_tail={tail}"] = {"advantages": t(a), "returns": t(r)}
out["estimators"] = est


# ---------------------------------------------------------------- policy losses
def actor(**kw):
    pl = PolicyLossConfig(**kw.pop("policy_loss", {}))
    base = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                global_batch_info={}, policy_loss=pl)
    base.update(kw)
    return ActorConfig(**base)


losses = {}


def run_loss(key, name, cfg, agg_mode="token-mean", weights=None, **info):
    lp = log_prob.clone().requires_grad_(True)
    cfg["global_batch_info"] = info
    fn = C.get_policy_loss_fn(name)
    loss, metrics = fn(old_log_prob, lp, advantages, mask, agg_mode, cfg, rollout_is_weights=weights)
    loss.backward()
    losses[key] = {"loss": float(loss), "grad": t(lp.grad),
                   "metrics": {k: float(v) for k, v in metrics.items()}}


for mode in ["token-mean", "seq-mean-token-mean", "token-sum"]:
    run_loss(f"vanilla|{mode}|is_weights", "vanilla", actor(), mode, is_weights)
run_loss("vanilla|token-mean|global", "vanilla", actor(), "token-mean", None, dp_size=2, batch_num_tokens=40,
         global_batch_size=12)
run_loss("dro|beta=0.5", "dro", actor(policy_loss={"dro_beta": 0.5}))
run_loss("dro|beta=0.5|seq-mean-token-sum|is_weights", "dro", actor(policy_loss={"dro_beta": 0.5}),
         "seq-mean-token-sum", is_weights)
for name in ("dppo_tv", "dppo_kl"):
    run_loss(f"{name}|clip=0.05", name, actor(clip_ratio=0.05, clip_ratio_c=20.0))
    run_loss(f"{name}|low=0.02,high=0.08,c=1.5", name,
             actor(clip_ratio=0.05, clip_ratio_low=0.02, clip_ratio_high=0.08, clip_ratio_c=1.5))
bypass_cases = {
    "ppo_clip|token": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0},
    "reinforce|token": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.2},
    "reinforce|sequence": {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "reinforce|none": {"loss_type": "reinforce", "rollout_is": None},
    "reinforce|token|rs=token_k1": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0,
                                    "rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    "ppo_clip|rs=seq_mean_k3": {"loss_type": "ppo_clip", "rollout_is": None, "rollout_rs": "seq_mean_k3",
                                "rollout_rs_threshold": 0.08},
}
for key, rc in bypass_cases.items():
    # bypass mode: old_log_prob is the rollout's
    lp = log_prob.clone().requires_grad_(True)
    cfg = actor(policy_loss={"rollout_correction": rc})
    loss, metrics = C.compute_policy_loss_bypass_mode(rollout_log_prob, lp, advantages, mask, "token-mean", cfg)
    loss.backward()
    losses[f"bypass_mode|{key}"] = {"loss": float(loss), "grad": t(lp.grad), "config": rc,
                                    "metrics": {k: float(v) for k, v in metrics.items()}}
out["policy_losses"] = losses

# ---------------------------------------------------------------- rollout correction (decoupled: old vs rollout)
rc_cases = {
    "tis_token_2.0": dict(rollout_is="token", rollout_is_threshold=2.0),
    "tis_token_1.1_batchnorm": dict(rollout_is="token", rollout_is_threshold=1.1, rollout_is_batch_normalize=True),
    "tis_sequence_2.0": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "tis_sequence_3.0_batchnorm": dict(rollout_is="sequence", rollout_is_threshold=3.0,
                                       rollout_is_batch_normalize=True),
    "icepop_token_0.8_1.25": dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
    "rs_token_k1": dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    "rs_token_k2_k3": dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.01,0.02"),
    "rs_seq_sum_k1": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold=1.5),
    "rs_seq_mean_k3_seq_max_k2": dict(rollout_rs="seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.02,0.05"),
    "tis_token_and_rs_seq_mean_k2": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k2",
                                         rollout_rs_threshold=0.01),
}
rc_out = {}
for key, kw in rc_cases.items():
    w, m, metrics = H.compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, mask, **kw)
    rc_out[key] = {"config": kw, "rollout_is_weights": t(w.batch["rollout_is_weights"]) if w is not None else None,
                   "response_mask": t(m), "metrics": {k: float(v) for k, v in metrics.items()}}
out["rollout_correction"] = rc_out

with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
print("wrote", sys.argv[1])
