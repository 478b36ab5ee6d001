"""The ``diffusers`` rollout's fast path gives exactly what the plain one gives: text embeddings encoded once per
distinct prompt (LRU cache), the sampler's precomputed step coefficients, zero-copy collation; and the
noise of a prompt group does not depend on how its samples are cut into generation calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.sampler import plan_steps, sample_trajectory, sde_step, sigma_schedule
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import RolloutConfig
from polyrl.protocols import GenerationRequest, SamplingParams

PROMPTS = ["a red house", "a dark sky", "a photo of a cat", "a green tree"]
NEGATIVES = ["dull", "grey", "dark", "pale"]


@pytest.fixture(scope="module", params=["sd3", "flux"])
def model_dir(request, tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=0)


def _rollout(path, max_batch_size=64, text_cache_size=64, **sampler):
    from polyrl_diffusion.rollout import DiffusersRollout

    cfg = FlowGRPOConfig(**{"train_steps": 6, "sde_window_size": 3, "sde_window_start": 1, **sampler})
    opts = DiffusersRolloutConfig(sampler=cfg, max_batch_size=max_batch_size, text_cache_size=text_cache_size)
    return DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=opts), model_path=str(path))


def _requests(n=2, seed=3):
    """One request per sample, a group's requests sharing their id (what the ``diffusion`` agent loop sends)."""
    return [GenerationRequest([], SamplingParams(n=1, seed=seed), request_id=f"g{g}",
                              multi_modal={"prompt": PROMPTS[g], "negative_prompt": NEGATIVES[g], "train_step": 1})
            for g in range(len(PROMPTS)) for _ in range(n)]


def _encoded_rows(rollout):
    """Count the prompts the text encoder sees."""
    count = {"rows": 0}
    encode = rollout.model.encode

    def counting(prompts):
        count["rows"] += len(prompts)
        return encode(prompts)

    rollout.model.encode = counting
    return count


def _assert_same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.extra.keys() == rb.extra.keys()
        for key, value in ra.extra.items():
            other = rb.extra[key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"field {key} of {ra.request_id}/{ra.sample_index} differs"


def test_cached_embeddings_give_exactly_the_uncached_outputs(model_dir):
    cached = _rollout(model_dir, cfg_scale=2.0, timestep_fraction=0.67)
    plain = _rollout(model_dir, cfg_scale=2.0, timestep_fraction=0.67)
    plain.embed = lambda prompts: plain.model.encode(list(prompts))  # the old path: every row encoded
    count = _encoded_rows(cached)
    first = cached.generate(_requests())
    _assert_same(first, plain.generate(_requests()))
    assert count["rows"] == 2 * len(PROMPTS), "each distinct prompt and negative prompt is encoded once"
    again = cached.generate(_requests())  # every prompt now comes from the cache
    assert count["rows"] == 2 * len(PROMPTS)
    _assert_same(again, first)
    fresh = _rollout(model_dir, cfg_scale=2.0, timestep_fraction=0.67)
    emb = fresh.embed(PROMPTS + PROMPTS[::-1])
    ref = fresh.model.encode(PROMPTS)
    assert torch.equal(emb.prompt_embeds[:4], ref.prompt_embeds) and torch.equal(emb.pooled[4:], ref.pooled.flip(0))


def test_text_cache_is_a_bounded_lru(model_dir):
    rollout = _rollout(model_dir, text_cache_size=2)
    count = _encoded_rows(rollout)
    rollout.embed(PROMPTS[:3])
    assert list(rollout._text_cache) == PROMPTS[1:3]  # the oldest went
    rollout.embed([PROMPTS[1]])  # a hit refreshes it
    rollout.embed([PROMPTS[3]])
    assert list(rollout._text_cache) == [PROMPTS[1], PROMPTS[3]] and count["rows"] == 4
    rollout.clear_text_cache()
    assert not rollout._text_cache
    off = _rollout(model_dir, text_cache_size=0)
    off.embed(PROMPTS)
    assert not off._text_cache


def test_split_groups_get_distinct_noise_whatever_the_chunking(model_dir):
    whole = collate_images([SimpleNamespace(extra=r.extra) for r in _rollout(model_dir).generate(_requests(n=4))])
    cut = collate_images([SimpleNamespace(extra=r.extra)
                          for r in _rollout(model_dir, max_batch_size=3).generate(_requests(n=4))])
    noise = cut["initial_noise"].flatten(1)
    assert len({tuple(row.tolist()) for row in noise}) == 16, "two samples of a group share their initial noise"
    assert torch.equal(cut["initial_noise"], whole["initial_noise"])


def test_precomputed_step_coefficients_match_sde_step_exactly():
    cfg = FlowGRPOConfig(train_steps=6, sde_window_size=4, sde_window_start=1, noise_schedule="linear",
                         noise_level_min=0.2, timestep_fraction=0.5)
    import random

    plan = plan_steps(cfg, 0, rng=random.Random(0))
    sigmas = sigma_schedule(6, 3.0)
    x0 = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    trained = [plan.trained_indices] * 5

    def velocity(x, s):
        return torch.tanh(x * 1.3) - s.reshape(-1, 1, 1, 1)

    traj = sample_trajectory(velocity, x0, sigmas, plan, trained, generator=torch.Generator().manual_seed(1))
    gen, x, kept = torch.Generator().manual_seed(1), x0, []
    for k in range(plan.num_steps):
        level = plan.noise_levels[k] if plan.sde[k] else 0.0
        out = sde_step(x, velocity(x, sigmas[k].expand(5)), sigmas[k], sigmas[k + 1], level, generator=gen)
        if plan.trained[k]:
            kept.append((x, out.prev_sample, out.log_prob))
        x = out.prev_sample
    assert torch.equal(traj.x0, x)
    assert torch.equal(traj.latents, torch.stack([t[0] for t in kept], 1))
    assert torch.equal(traj.next_latents, torch.stack([t[1] for t in kept], 1))
    assert torch.equal(traj.log_probs, torch.stack([t[2] for t in kept], 1))


def test_collate_takes_consecutive_rows_without_copying():
    base = torch.randn(5, 2, 3)
    outs = [SimpleNamespace(extra={"rows": base[i], "shared": torch.ones(2), "reversed": base[4 - i], "x": float(i)})
            for i in range(5)]
    batch = collate_images(outs)
    assert torch.equal(batch["rows"], base) and batch["rows"].data_ptr() == base.data_ptr()
    assert torch.equal(batch["reversed"], base.flip(0)) and batch["reversed"].data_ptr() != base.data_ptr()
    assert torch.equal(batch["shared"], torch.ones(5, 2)) and batch["x"].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(collate_images(outs[1:3])["rows"], base[1:3])
