"""QwenImage specifics: its text (template prefix dropped, a length per prompt, padded with a mask), its
norm-preserving true CFG, the text length a run pads to, and its bad input. (Image for image against diffusers' ``QwenImagePipeline``: test_real_pipelines.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import (
    QwenPromptLengths,
    _pack,
    _patch_norm,
    load_flow_model,
    make_tiny_diffusers_pipeline,
    make_tiny_pipeline,
)
from polyrl_diffusion.sampler import guided
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.errors import ConfigError
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams

PIXELS = 16


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_diffusers_pipeline(tmp_path_factory.mktemp("qwen") / "m", family="qwenimage", seed=0)


def _rollout(path, text_length=0, **sampler):
    from polyrl_diffusion.rollout import DiffusersRollout

    cfg = FlowGRPOConfig(**{"height": PIXELS, "width": PIXELS, **sampler})
    opts = DiffusersRolloutConfig(sampler=cfg, text_length=text_length)
    return DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=opts), model_path=str(path))


def _batch(rollout, prompts, negatives=None, validate=False, seed=5):
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=seed), request_id=f"u{i}",
                              multi_modal={"prompt": p, "train_step": 0, "validate": validate,
                                           **({"negative_prompt": negatives[i]} if negatives else {})})
            for i, p in enumerate(prompts)]
    return collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(reqs)])


def test_the_template_prefix_is_what_the_pipeline_drops(qwen_dir):
    """The tiny tokenizer splits QwenImage's system prefix into as many tokens as the real one (34, the pipeline's
    drop index), so the embeddings are the user's text and the template's closing tokens only."""
    count = QwenPromptLengths.from_folder(qwen_dir)
    prefix = count.template.split("{}")[0]
    assert len(count.tokenizer(prefix)["input_ids"]) == count.drop == 34
    suffix = len(count.tokenizer(count.template.split("{}")[1])["input_ids"])
    for prompt, words in [("a bright red cat", 4), ("", 0), ("a dark sea in the night", 6)]:
        assert count(prompt) == words + suffix
    model = load_flow_model(qwen_dir)
    a, b = model.encode(["a red cat"]), model.encode(["a red dog"])
    # the encoder is causal: rows before the first different word agree, so row 0 is the prompt's first word
    assert torch.allclose(a.prompt_embeds[0, :2], b.prompt_embeds[0, :2])
    assert not torch.allclose(a.prompt_embeds[0, 2], b.prompt_embeds[0, 2])


def test_true_cfg_keeps_the_conditional_norm_of_each_patch():
    """QwenImage's CFG: ``comb * |v_c| / |comb|`` per packed 2x2 latent patch (over its 4C values)."""
    torch.manual_seed(0)
    x, sigma = torch.randn(3, 4, 8, 8), torch.full((3,), 0.5)
    v_c, v_u = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)

    def velocity(xx, ss, emb):
        return torch.cat([v_c, v_u]) if emb == "both" else v_c

    out = guided(velocity, x, sigma, "c", "u", 4.0, lambda a, b: "both", _patch_norm)
    comb = v_u + 4.0 * (v_c - v_u)
    norms = torch.linalg.vector_norm(_pack(out), dim=-1)
    assert torch.allclose(norms, torch.linalg.vector_norm(_pack(v_c), dim=-1), atol=1e-5)
    direction = _pack(out) / norms[..., None]
    assert torch.allclose(direction, _pack(comb) / torch.linalg.vector_norm(_pack(comb), dim=-1)[..., None], atol=1e-5)
    plain = guided(velocity, x, sigma, "c", "u", 4.0, lambda a, b: "both")
    assert torch.allclose(plain, comb)


def test_rows_of_different_text_lengths_train_as_they_were_sampled(qwen_dir):
    """Two generation calls whose prompts differ in length (no text_length: each call pads to its own longest):
    the collated batch pads the text and its masks, and the engine recomputes every row's log-probs, with CFG and
    negative prompts of their own lengths. Without the mask the padded rows would see zeros as text."""
    from polyrl_diffusion.engine import DiffusersEngine

    rollout = _rollout(qwen_dir, train_steps=3, cfg_scale=2.5)
    first = rollout.generate([GenerationRequest([], SamplingParams(n=1, seed=1), request_id="a",
                                                multi_modal={"prompt": "a cat", "negative_prompt": "dull"})])
    second = rollout.generate([GenerationRequest([], SamplingParams(n=1, seed=2), request_id="b", multi_modal={
        "prompt": "a bright red house in a dark forest", "negative_prompt": "a pale grey photo of a dull sky"})])
    short, long_ = first[0].extra["prompt_embeds"].shape[0], second[0].extra["prompt_embeds"].shape[0]
    assert short < long_
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in first + second])
    assert batch["prompt_embeds"].shape[1] == long_
    assert batch["prompt_embeds_mask"].sum(-1).tolist() == [short, long_]
    assert batch["negative_prompt_embeds_mask"][0].sum() < batch["negative_prompt_embeds_mask"][1].sum()
    assert batch["pooled_prompt_embeds"].shape == (2, 0)
    engine = DiffusersEngine(EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(qwen_dir)),
                                              optim=OptimConfig(lr=1e-3), micro_batch_size=2),
                             role="actor", model_type="diffusion", platform=CPUPlatform())
    assert torch.allclose(engine.infer_batch(batch)["log_probs"], batch["rollout_log_probs"], atol=1e-5)
    unmasked = batch.clone()
    unmasked["prompt_embeds_mask"] = torch.ones_like(batch["prompt_embeds_mask"])
    assert not torch.allclose(engine.infer_batch(unmasked)["log_probs"][0], batch["rollout_log_probs"][0], atol=1e-4)


def test_text_length_pads_every_call_and_refuses_a_longer_prompt(qwen_dir):
    count = QwenPromptLengths.from_folder(qwen_dir)
    rollout = _rollout(qwen_dir, text_length=20, train_steps=2)
    batch = _batch(rollout, ["a cat", "a red house"])
    assert batch["prompt_embeds"].shape[1] == 20
    assert batch["prompt_embeds_mask"].sum(-1).tolist() == [count("a cat"), count("a red house")]
    with pytest.raises(ValueError, match=r"rollout\.diffusers\.text_length=20"):
        _batch(rollout, ["a red house " * 6])


@pytest.fixture(scope="module")
def run_files(tmp_path_factory, qwen_dir):
    root = tmp_path_factory.mktemp("qwen_run")
    prompts = ["a cat", "a bright red house in a dark forest", "a tree", "a sky"]
    (root / "ok.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    (root / "long.jsonl").write_text("\n".join(json.dumps({"prompt": "a red house " * k}) for k in (1, 200)))
    (root / "m.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return root, prompts


def _config(root, model, data, tmp_path, extra=()):
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.plugins import get_plugin_manager

    pm = get_plugin_manager()
    config = load_config(PolyrlConfig, [], [
        f"model.path={model}", f"data.train_files=[{root / data}]", "data.train_batch_size=4", "actor.engine=diffusers",
        "rollout.name=diffusers", "trainer.name=flow_grpo", "trainer.executor=local", "algorithm.adv_estimator=flow_grpo",
        "actor.policy_loss.loss_mode=flow_grpo", "reward.function=brightness", "actor.ppo_mini_batch_size=4",
        "rollout.n=2", "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}", "trainer.flow_grpo.height=16",
        "trainer.flow_grpo.width=16", *extra], plugins=pm)
    return config, pm


def test_the_trainer_pads_to_the_datas_longest_prompt(run_files, qwen_dir, tmp_path):
    """Before any worker starts, the longest prompt or negative prompt of the data (in QwenImage's text rows)
    becomes rollout.diffusers.text_length, so every rank's and every call's rows line up."""
    from polyrl_diffusion.trainer import FlowGRPOTrainer

    root, prompts = run_files
    count = QwenPromptLengths.from_folder(qwen_dir)
    config, pm = _config(root, qwen_dir, "ok.jsonl", tmp_path)
    FlowGRPOTrainer(config, plugins=pm)
    assert config.rollout.plugin_config.text_length == max(count(p) for p in [*prompts, ""])
    negative = "a pale grey photo of a dull sky at night in the city"
    config, pm = _config(root, qwen_dir, "ok.jsonl", tmp_path, [f"trainer.flow_grpo.negative_prompt='{negative}'"])
    FlowGRPOTrainer(config, plugins=pm)
    assert config.rollout.plugin_config.text_length == count(negative) > max(count(p) for p in prompts)
    config, pm = _config(root, qwen_dir, "ok.jsonl", tmp_path, ["rollout.diffusers.text_length=64"])
    FlowGRPOTrainer(config, plugins=pm)
    assert config.rollout.plugin_config.text_length == 64  # a run's own setting wins


def test_a_prompt_longer_than_qwenimage_takes_is_refused_with_its_row(run_files, qwen_dir, tmp_path):
    from polyrl_diffusion.trainer import FlowGRPOTrainer

    root, _ = run_files
    config, pm = _config(root, qwen_dir, "long.jsonl", tmp_path)
    with pytest.raises(ConfigError, match=r"long\.jsonl row 1: 'prompt' is \d+ tokens; the text encoder .* takes 512"):
        FlowGRPOTrainer(config, plugins=pm)


def test_tiny_qwenimage_pipeline_has_masked_text(tmp_path):
    """make_tiny_pipeline(family='qwenimage'): QwenImage's transformer on the identity latent space, its text the
    prompt's own tokens with a mask (as QwenImage's), no pooled embedding."""
    path = make_tiny_pipeline(tmp_path / "m", family="qwenimage", seed=0)
    model = load_flow_model(path)
    assert (model.family, model.tiny, model.masked_text) == ("qwenimage", True, True)
    emb = model.encode(["a cat", "a bright red house"])
    assert emb.pooled.shape == (2, 0) and emb.mask.sum(-1).tolist() == [4, 6]  # [BOS] words [EOS]
    v = model.velocity(torch.randn(2, 3, 8, 8), torch.full((2,), 0.5), emb)
    assert v.shape == (2, 3, 8, 8)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny QwenImage pipeline (``make_tiny_pipeline(family="qwenimage")``) and prompts of different lengths."""
    root = tmp_path_factory.mktemp("qwen_algos")
    model = make_tiny_pipeline(root / "model", family="qwenimage", seed=0)
    rows = [{"prompt": p} for p in ["a cat", "a bright red house in a dark forest", "a tree", "a sky"]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return root, model


@pytest.mark.parametrize("name, extra", [
    ("flow_grpo_fast_true_cfg", ["trainer.flow_grpo.sde_window_size=2", "trainer.flow_grpo.cfg_scale=2.5",
                                 "trainer.flow_grpo.negative_prompt='a dull grey photo'"]),
    ("mix_grpo", ["trainer.flow_grpo.mix_grpo.enable=true", "trainer.flow_grpo.mix_grpo.window_size=2"]),
    ("dance_grpo", ["trainer.flow_grpo.dance_grpo.enable=true"]),
    ("diffusion_nft", ["trainer.flow_grpo.algorithm=diffusion_nft"]),
])
def test_every_diffusion_algorithm_trains_tiny_qwenimage(tiny_run, tmp_path, name, extra):
    """Two steps of each algorithm on QwenImage's transformer through the whole trainer (one process): the
    weights move, and for the SDE algorithms the engine's recomputed log-probs of the first step are the rollout's
    (ratio 1: the same masked text, packing and, with CFG, the same norm-preserving true CFG in both)."""
    from polyrl_diffusion.quickstart import flow_grpo_overrides

    from polyrl.trainer.commands import train

    root, model = tiny_run
    run = tmp_path / name
    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(model, root / "train.jsonl", run, batch=2, n=2, lr=1e-2, steps=2, sampler_steps=4),
        "trainer.save_freq=0", *extra])
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor/grad_norm" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    if name != "diffusion_nft":
        assert abs(rows[0]["actor/ratio_mean"] - 1.0) < 1e-4 and abs(rows[0]["rollout/logprob_diff_mean"]) < 1e-4

