"""A sign advantage: each sample gets +1, -1 or 0 by whether its reward beats its group's mean.

Scale-free and robust to reward outliers; a small example of verl's estimator signature.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def sign_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                   config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``sign(r - mean_group(r))`` on every response token; zero on masked tokens."""
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape")
    valid = response_mask != 0
    if not torch.isfinite(token_level_rewards[valid]).all():
        raise ValueError("token_level_rewards holds NaN/inf on response tokens")
    # select, not multiply: whatever padding holds (NaN included) must not change the result
    rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
    scores = rewards.sum(-1).double()
    if index is None:
        index = np.zeros(scores.shape[0])
    _, groups = np.unique(np.asarray(index).astype(str), return_inverse=True)
    gid = torch.as_tensor(groups.reshape(-1), dtype=torch.long)
    n = int(gid.max()) + 1
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, gid, scores)
    counts = torch.bincount(gid, minlength=n).double()
    adv = torch.sign(scores - (sums / counts)[gid]).to(token_level_rewards.dtype)
    out = torch.where(valid, adv.unsqueeze(-1).expand_as(rewards), torch.zeros_like(rewards))
    return out, out
