"""GiGPO's advantages against plain-Python loops over fixed episodes that share anchor states.

The loops below follow the paper's definitions step by step (lists and dicts, no tensors): the episode advantage
is each step row's score centred (and optionally scaled) on its episode group; the step advantage is the discounted
return of the step centred on the rows of the same episode group that acted from the same anchor state.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from polyrl.algorithms import get_adv_estimator_fn

#: Two episode groups (uids "a" and "b"). Each episode: its step rewards and the anchor state of each step.
EPISODES = {
    # uid a: three trajectories from one start; states s0 -> s1 -> ... (shared s0, s1 across episodes)
    ("a", 10): ([0.0, 0.0, 1.0], ["s0", "s1", "s2"]),
    ("a", 11): ([0.0, -0.5], ["s0", "s1"]),
    ("a", 12): ([0.0, 0.0, 0.0, 2.0], ["s0", "s3", "s1", "s2"]),
    # uid b: the same state names, but another episode group: never grouped with uid a's
    ("b", 20): ([1.0], ["s0"]),
    ("b", 21): ([0.0, 0.5], ["s0", "s9"]),
}
GAMMA = 0.9
EPS = 1e-6


def rows() -> list[dict]:
    out = []
    for (uid, eid), (rewards, anchors) in EPISODES.items():
        total = sum(rewards)
        for t, (r, a) in enumerate(zip(rewards, anchors)):
            out.append({"uid": uid, "episode": eid, "t": t, "reward": r, "anchor": a, "score": total})
    return out


def discounted(rewards: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def reference(mode: str, w: float, episode_stats: str) -> list[float]:
    table = rows()
    for row in table:
        rewards = EPISODES[(row["uid"], row["episode"])][0]
        row["return"] = discounted(rewards, GAMMA)[row["t"]]
    advantages = []
    for row in table:
        if episode_stats == "steps":
            members = [r["score"] for r in table if r["uid"] == row["uid"]]
        else:
            members = [sum(EPISODES[k][0]) for k in EPISODES if k[0] == row["uid"]]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(members), statistics.stdev(members)
        episode_adv = row["score"] - mean
        if mode == "mean_std_norm":
            episode_adv /= std + EPS
        group = [r["return"] for r in table if r["uid"] == row["uid"] and r["anchor"] == row["anchor"]]
        if len(group) == 1:
            step_adv = 0.0
        else:
            step_adv = row["return"] - statistics.mean(group)
            if mode == "mean_std_norm":
                step_adv /= statistics.stdev(group) + EPS
        advantages.append(episode_adv + w * step_adv)
    return advantages


def batch(response_length: int = 5):
    table = rows()
    b = len(table)
    lengths = torch.tensor([1 + (i * 3) % response_length for i in range(b)])
    mask = (torch.arange(response_length)[None, :] < lengths[:, None]).float()
    scores = torch.zeros(b, response_length)
    scores[torch.arange(b), lengths - 1] = torch.tensor([r["score"] for r in table])
    anchors = {name: i for i, name in enumerate(sorted({r["anchor"] for r in table}))}
    kwargs = {
        "step_rewards": torch.tensor([r["reward"] for r in table]),
        "anchor_key": torch.tensor([anchors[r["anchor"]] * 7919 for r in table]),
        "episode_id": torch.tensor([r["episode"] for r in table]),
        "step_index": torch.tensor([r["t"] for r in table]),
    }
    index = np.array([r["uid"] for r in table], dtype=object)
    return scores, mask, index, kwargs


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("w", [1.0, 0.5])
@pytest.mark.parametrize("episode_stats", ["steps", "trajectories"])
def test_gigpo_matches_the_hand_written_loops(mode, w, episode_stats):
    scores, mask, index, kwargs = batch()
    fn = get_adv_estimator_fn("gigpo")
    adv, ret = fn(token_level_rewards=scores, response_mask=mask, index=index, config={"gamma": GAMMA},
                  step_advantage_w=w, mode=mode, episode_stats=episode_stats, **kwargs)
    expected = torch.tensor(reference(mode, w, episode_stats))
    torch.testing.assert_close(adv, expected[:, None] * mask, atol=1e-5, rtol=1e-5)
    assert torch.equal(adv, ret)


def test_shared_anchor_states_separate_good_and_bad_steps():
    """From s1, episode 10's step (return 0.9) beats episode 11's (-0.5): the step advantages differ in sign even
    where the episode advantage alone would not tell the steps apart."""
    scores, mask, index, kwargs = batch()
    fn = get_adv_estimator_fn("gigpo")
    with_steps, _ = fn(token_level_rewards=scores, response_mask=mask, index=index, config={"gamma": GAMMA}, **kwargs)
    no_steps, _ = fn(token_level_rewards=scores, response_mask=mask, index=index, config={"gamma": GAMMA},
                     step_advantage_w=0.0, **kwargs)
    table = rows()
    i10 = next(i for i, r in enumerate(table) if r["episode"] == 10 and r["anchor"] == "s1")
    i11 = next(i for i, r in enumerate(table) if r["episode"] == 11 and r["anchor"] == "s1")
    step_part = (with_steps - no_steps)[:, 0]
    assert step_part[i10] > 0 > step_part[i11]
    # a state only one row met (s3, s9) gets no step advantage
    lone = [i for i, r in enumerate(table) if r["anchor"] in ("s3", "s9")]
    assert torch.all(step_part[lone] == 0)


def test_w_zero_and_one_step_episodes_are_grpo_over_step_rows():
    scores, mask, index, kwargs = batch()
    gigpo, _ = get_adv_estimator_fn("gigpo")(token_level_rewards=scores, response_mask=mask, index=index,
                                             step_advantage_w=0.0, mode="mean_std_norm", **kwargs)
    grpo, _ = get_adv_estimator_fn("grpo")(token_level_rewards=scores, response_mask=mask, index=index)
    torch.testing.assert_close(gigpo, grpo)


def test_padding_copies_change_no_real_row():
    """A padding row (the trainer's: a copy of the last row, mask 0, rewards 0, a uid of its own) leaves every
    real row's advantage as it was."""
    scores, mask, index, kwargs = batch()
    fn = get_adv_estimator_fn("gigpo")
    base, _ = fn(token_level_rewards=scores, response_mask=mask, index=index, config={"gamma": GAMMA}, **kwargs)
    padded = {k: torch.cat([v, v[-1:] * (0 if k == "step_rewards" else 1)]) for k, v in kwargs.items()}
    p_scores = torch.cat([scores, scores[-1:]])
    p_mask = torch.cat([mask, torch.zeros_like(mask[-1:])])
    p_index = np.array(list(index) + ["b#pad0"], dtype=object)
    out, _ = fn(token_level_rewards=p_scores, response_mask=p_mask, index=p_index, config={"gamma": GAMMA}, **padded)
    torch.testing.assert_close(out[:-1], base)
    assert torch.all(out[-1] == 0)


def test_missing_step_fields_name_the_loop():
    scores, mask, index, _ = batch()
    with pytest.raises(ValueError, match="step_rewards.*stepwise"):
        get_adv_estimator_fn("gigpo")(token_level_rewards=scores, response_mask=mask, index=index)
