"""PF-PPO's weights against verl's formulas and its resampling's distribution."""

from __future__ import annotations

import pytest
import torch
from polyrl_recipes.pf_ppo import pf_ppo_resample, pf_ppo_weights

SCORES = torch.tensor([0.0, -1.0, 0.5, 2.0, 2.0, -1.0, 1.0])


def test_weights_follow_verls_methods():
    assert pf_ppo_weights(SCORES, "pow", 2.0).tolist() == pytest.approx([abs(s) ** 2 for s in SCORES.tolist()])
    assert pf_ppo_weights(SCORES, "pow", 0.5).tolist() == pytest.approx([abs(s) ** 0.5 for s in SCORES.tolist()])
    # the batch's best (2.0) and worst (-1.0) scores only
    assert pf_ppo_weights(SCORES, "max_min").tolist() == [0, 1, 0, 1, 1, 1, 0]
    assert pf_ppo_weights(SCORES, "max_random").tolist() == pytest.approx([0.1, 0.1, 0.1, 0.4, 0.4, 0.1, 0.1])
    with pytest.raises(ValueError, match="reweight_method='best'"):
        pf_ppo_weights(SCORES, "best")


def test_resampling_draws_in_proportion_to_the_weights():
    scores = SCORES.repeat(3000)  # 21000 draws of the same 7 scores
    rows = pf_ppo_resample(scores, "pow", 2.0, torch.Generator().manual_seed(0))
    assert rows.shape == scores.shape
    drawn = torch.bincount(rows % 7, minlength=7).double() / rows.numel()
    weights = SCORES.abs().double() ** 2 + 1e-8
    assert torch.allclose(drawn, weights / weights.sum(), atol=0.01)
    assert drawn[0] < 1e-3  # a zero score is drawn only through the 1e-8 floor


def test_max_min_never_draws_the_middle_and_the_draw_is_seeded():
    rows = pf_ppo_resample(SCORES, "max_min", generator=torch.Generator().manual_seed(3))
    assert set(rows.tolist()) <= {1, 3, 4, 5}
    again = pf_ppo_resample(SCORES, "max_min", generator=torch.Generator().manual_seed(3))
    assert torch.equal(rows, again)


def test_all_zero_scores_draw_uniformly():
    rows = pf_ppo_resample(torch.zeros(4000), "pow", 2.0, torch.Generator().manual_seed(1))
    counts = torch.bincount(rows % 4, minlength=4).double() / rows.numel()
    assert torch.allclose(counts, torch.full((4,), 0.25, dtype=torch.float64), atol=0.03)
