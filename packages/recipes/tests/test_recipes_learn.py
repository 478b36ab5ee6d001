"""Each recipe end to end through ``polyrl train`` (the FSDP engine, the built-in hf rollout, the local executor):
it learns the quickstart's arithmetic prompts with the digits reward, against a no-signal control.

The task: answer ``a+b=`` in digits (the reward is the fraction of digits among the first 6 characters), which a
random-init tiny model learns in about 20 steps of 4 prompts x 4 samples. The measure is the train batches'
digit fraction (``acc/mean``: the samples of step k come from the policy after k - 1 updates; for PF-PPO
``pf_ppo/acc_mean_before``, the batch before resampling). Passing: the mean of the last 4 steps is at least
0.5 and at least 0.35 above the first 4.

Measured (2026-12, 2 CPU cores, 20 steps, ``trainer.seed`` 1/2/3), mean of the first 4 steps -> of the last 4:

| recipe | digits reward | control (a hash of the answer; ``acc`` still the digit fraction) |
|---|---|---|
| remax (lr 3e-2) | 0.07 -> 0.99, 0.05 -> 0.98, 0.04 -> 0.99 | 0.05 -> 0.29, 0.03 -> 0.00, 0.03 -> 0.18 |
| vapo (30 steps) | 0.03 -> 0.99, 0.05 -> 0.90, 0.01 -> 0.88 | 0.03 -> 0.01, 0.05 -> 0.01, 0.03 -> 0.02 |
| pf_ppo (after gae) | 0.05 -> 0.95, 0.04 -> 1.00, 0.04 -> 0.99 | 0.05 -> 0.00, 0.04 -> 0.02, 0.03 -> 0.01 |
| sppo | 0.05 -> 0.95, 0.04 -> 0.97, 0.03 -> 0.94 | 0.05 -> 0.03, 0.04 -> 0.02, 0.02 -> 0.02 |
| prime (``prime_norm: none``) | 0.05 -> 0.92, 0.04 -> 0.95, 0.03 -> 0.93 | 0.05 -> 0.03, 0.04 -> 0.01, 0.02 -> 0.04 |
| optimal_token_baseline | 0.05 -> 0.97, 0.04 -> 0.97, 0.03 -> 0.99 | 0.05 -> 0.05, 0.04 -> 0.02, 0.02 -> 0.04 |

VAPO runs 30 steps (``STEPS_OF``): its first 2 train the critic alone and it takes off later than the others, between
steps 16 and 28 (2026-12-01, seeds 1-6 at 30 steps: 0.99, 0.90, 0.88, 0.57, 0.97, 0.98; at 20 steps 0.49, 0.19, 0.13,
0.07, 0.23, 0.43 with the hf rollout's inverse-CDF sampler and 0.65, 0.17, 0.39, 0.23, 0.07, 0.46 with
``torch.multinomial`` before it: 20 steps passed only on the lucky seed). No control run passes (the highest, ReMax's at lr 3e-2, ends at 0.29); every real run does. PRIME with verl's
``prime_norm: batch_norm`` passed 1 seed of 3 at ``reward_dpo_coef`` 1 (0.75, 0.33, 0.41) and all 3 at 0.5: the
normaliser scales the implicit rewards of a PRM that 20 steps barely trained up to unit size, where they compete
with the outcome; unnormalised they are ``beta = 0.05`` times small log-ratios and grow as the PRM learns. A run
takes 3-7 s in a warm process on 2 cores (10-45 s as its own process, with other jobs on the cores).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from polyrl.trainer.commands import train

sys.path.insert(0, str(Path(__file__).parent))
from recipes_testkit import train_rows  # noqa: E402

STEPS = 20
CRITIC = ["critic.optim.lr=1e-3", "critic.ppo_mini_batch_size=4", "critic.micro_batch_size=16"]
RECIPES = {
    "remax": ["trainer.name=remax", "actor.optim.lr=3e-2"],
    "vapo": ["trainer.name=vapo", "trainer.vapo.value_pretrain_steps=2", *CRITIC],
    "pf_ppo": ["trainer.name=pf_ppo", "algorithm.adv_estimator=gae", *CRITIC],
    "sppo": ["trainer.name=sppo"],
    # verl's coefficients (5 and 5); unnormalised implicit rewards (see the docstring and docs/recipes.md, "PRIME")
    "prime": ["trainer.name=prime", "trainer.prime.prm.optim.lr=1e-3", "trainer.prime.prime_norm=none"],
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
}
#: steps where a recipe needs more than ``STEPS`` (see the docstring)
STEPS_OF = {"vapo": 30}
#: what each recipe must have logged (its own metrics)
METRICS = {
    "remax": ["remax/baseline_score_mean", "timing/gen_baseline"],
    "vapo": ["critic/vf_loss"],
    "pf_ppo": ["pf_ppo/unique_fraction", "pf_ppo/acc_mean_before", "critic/vf_loss"],
    "sppo": ["sppo/target_mean", "sppo/log_ratio_mean"],
    "prime": ["prm/loss", "prm/grad_norm", "prm/reward", "prm/pairwise_acc"],
    "optimal_token_baseline": ["timing/old_log_prob"],
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_learns_the_quickstart_task(recipe, base_overrides, manifest, tmp_path):
    overrides = [o for o in base_overrides if not o.startswith("trainer.total_steps")]
    steps = STEPS_OF.get(recipe, STEPS)
    train(manifest, [], overrides + [f"trainer.total_steps={steps}", *RECIPES[recipe]])
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in METRICS[recipe]:
            assert key in r and math.isfinite(r[key]), (recipe, r["step"], key)
    key = "pf_ppo/acc_mean_before" if recipe == "pf_ppo" else "acc/mean"
    acc = [r[key] for r in rows]
    first, last = sum(acc[:4]) / 4, sum(acc[-4:]) / 4
    assert last >= 0.5 and last >= first + 0.35, (recipe, [round(a, 2) for a in acc])
    if recipe == "vapo":  # value pre-training: the first 2 steps train the critic alone
        assert ["actor/grad_norm" in r for r in rows[:3]] == [False, False, True]
    if recipe == "prime":
        assert all(r["prm/grad_norm"] > 0 for r in rows)
