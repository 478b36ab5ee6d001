"""Flow-GRPO end to end on the tiny QwenImage pipeline: `polyrl train` with trainer.name=flow_grpo, the diffusers
engine and rollout, in one process (``trainer.executor=local``: Ray adds nothing to what this proves; the Ray path
is test_flow_grpo_e2e.py's).

``make_tiny_pipeline(family="qwenimage")`` is QwenImage's transformer (``QwenImageTransformer2DModel``: packed 2x2
latents, its text rows masked per prompt, no pooled embedding) on the identity latent space, random init. Trained
on the brightness reward, the mean reward of the last steps must clearly exceed the first steps', while the same
run with the rewards shuffled among the images of a batch (no signal) must not move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.trainer.commands import train

STEPS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from polyrl_diffusion.models import make_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_grpo_qwenimage")
    model = make_tiny_pipeline(root / "model", family="qwenimage", seed=0)
    # prompts of different lengths: each row's text has its own mask
    rows = [{"prompt": p, "data_source": "images"}
            for p in ["a photo of a cat", "a red house", "a dark sky over a bright field", "a tree"]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    (root / "shuffled.py").write_text(
        "import torch\n"
        "from polyrl_diffusion.rewards import brightness\n"
        "def shuffled_brightness(images, prompts):\n"
        "    scores = torch.as_tensor(brightness(images, prompts), dtype=torch.float32)\n"
        "    return scores[torch.randperm(len(scores))]\n")
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return {"root": root, "model": model}


def _run(setup: dict[str, Path], name: str, reward: str) -> list[float]:
    root = setup["root"]
    run = root / name
    from polyrl_diffusion.quickstart import flow_grpo_overrides

    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(setup["model"], root / "train.jsonl", run, batch=4, n=4, lr=6e-3, steps=STEPS,
                             sampler_steps=6, reward=reward, executor="local"),
        "trainer.flow_grpo.sde_window_size=3", "trainer.seed=3",
    ])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for r in train_rows:
        assert r["actor/grad_norm"] > 0 and r["diffusion/trained_steps"] == 3
    return [r["critic/score/mean"] for r in train_rows]


@pytest.mark.slow
def test_flow_grpo_on_qwenimage_raises_brightness_and_a_shuffled_control_does_not(setup):
    real = _run(setup, "real", "brightness")
    control = _run(setup, "control", f"{setup['root'] / 'shuffled.py'}:shuffled_brightness")
    gain = sum(real[-4:]) / 4 - sum(real[:4]) / 4
    drift = sum(control[-4:]) / 4 - sum(control[:4]) / 4
    assert gain > 0.05, real
    assert abs(drift) < gain / 2, (real, control)
