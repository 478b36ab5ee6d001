"""Flow-GRPO, MixGRPO, DanceGRPO and DiffusionNFT end to end on the one ``flow_grpo`` trainer.

``polyrl train`` (``executor=local``: every role in this process, so four algorithms and their controls fit
in about two minutes; the Ray path of the same trainer is covered by test_flow_grpo_e2e.py) trains the tiny
SD3-family pipeline (random init, built in code) on the offline ``brightness`` reward. For each algorithm
the mean reward of the last four steps must clearly exceed the first steps', while the same run with the
rewards shuffled among the images of each batch (no signal, same noise) must not move as much.
Runs are reproducible from ``trainer.seed`` (default 1). Measured with each algorithm's reference defaults
(16 steps, 4-step means, ``trainer.seed`` 1 / 2 / 3 / 4), gain and control drift:

- Flow-GRPO: 0.326 / 0.358 / 0.333 / 0.363, drift -0.015 / 0.049 / 0.017 / 0.114
- MixGRPO (window 2, moving every 2 steps): 0.336 / 0.369 / 0.385 / 0.388, drift -0.019 / 0.082 / 0.084 / 0.016
- DanceGRPO (eta 0.3, fraction 0.6): 0.253 / 0.237 / 0.128 / 0.170, drift 0.017 / -0.010 / 0.017 / 0.006
- DiffusionNFT: 0.380 / 0.337 / 0.232 / 0.329, drift 0.106 / 0.039 / -0.036 / -0.022

(before the reference defaults, seeds 1-4: gain 0.16-0.37, drift -0.11 to +0.10). About 20 s for all eight runs
on a quiet machine.
"""

from __future__ import annotations

import json

import pytest

from polyrl.trainer.commands import train

STEPS = 16  # with 8 steps a shuffled control's random walk once matched the real gain (CI, dance_grpo)
ALGORITHMS = {
    "flow_grpo": ["trainer.flow_grpo.sde_window_size=0"],
    "mix_grpo": ["trainer.flow_grpo.mix_grpo.enable=true", "trainer.flow_grpo.mix_grpo.window_size=2",
                 "trainer.flow_grpo.mix_grpo.shift_interval=2"],
    "dance_grpo": ["trainer.flow_grpo.dance_grpo.enable=true"],  # its recipe's eta 0.3 and fraction 0.6
    "diffusion_nft": ["trainer.flow_grpo.algorithm=diffusion_nft"],  # the authors' defaults: ODE sampling, K = 3
}
SHUFFLED = '''\
import numpy as np
import torch

from polyrl_diffusion.rewards import brightness

_rng = np.random.default_rng(0)


def shuffled_brightness(images, prompts):
    """brightness, permuted among the batch's images: the same reward values, no link to the image."""
    scores = torch.as_tensor(brightness(images, prompts), dtype=torch.float32)
    return scores[torch.from_numpy(_rng.permutation(len(scores)))]
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from polyrl_diffusion.models import make_tiny_pipeline

    root = tmp_path_factory.mktemp("diffusion_algos")
    model = make_tiny_pipeline(root / "model", family="sd3", seed=0)
    rows = [{"prompt": p, "data_source": "brightness"} for p in ["a photo of a cat", "a red house", "a dark sky",
                                                                 "a tree"]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    (root / "shuffled.py").write_text(SHUFFLED)
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return {"root": root, "model": model}


def _run(setup: dict, name: str, reward: str, extra: list[str]) -> list[dict]:
    root = setup["root"]
    run = root / name
    from polyrl_diffusion.quickstart import flow_grpo_overrides

    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(setup["model"], root / "train.jsonl", run, batch=4, n=4, lr=4e-3, steps=STEPS,
                             sampler_steps=4, reward=reward),
        *extra,
    ])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def _gain(rows: list[dict]) -> float:
    scores = [r["critic/score/mean"] for r in rows]
    return sum(scores[-4:]) / 4 - sum(scores[:4]) / 4


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_algorithm_raises_brightness_and_a_shuffled_control_does_not(setup, algo):
    real = _run(setup, f"{algo}-real", "brightness", ALGORITHMS[algo])
    control = _run(setup, f"{algo}-control", f"{setup['root'] / 'shuffled.py'}:shuffled_brightness",
                   ALGORITHMS[algo])
    gain, drift = _gain(real), _gain(control)
    assert gain > 0.1, (algo, [r["critic/score/mean"] for r in real])
    assert drift < gain / 2, (algo, gain, [r["critic/score/mean"] for r in control])
    for r in real:
        assert r["actor/grad_norm"] > 0
        if algo == "diffusion_nft":  # the forward-process loss, no per-step log-probs
            assert "actor/nft_loss" in r and "actor/pg_loss" not in r
        else:
            assert "actor/pg_loss" in r
