"""A flow_grpo run is reproducible from ``trainer.seed``: the same seed gives the same rewards and metrics step by
step, another seed different ones (rollout noise, trained-step subsets, DiffusionNFT's forward-process draws).

``polyrl train`` with ``executor=local`` on the tiny SD3-family pipeline, 3 steps; the generation is cut into
small pieces (``rollout.max_batch_size=5``, ``rollout.diffusers.max_batch_size=3``) so a prompt group spans
several generation calls, which must not change the draws either.
"""

from __future__ import annotations

import json

import pytest
from polyrl_diffusion.quickstart import flow_grpo_overrides

from polyrl.trainer.commands import train

STEPS = 3
#: metrics that measure the machine, not the run
VOLATILE = ("timing/", "throughput/", "perf/", "memory", "time")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from polyrl_diffusion.models import make_tiny_pipeline

    root = tmp_path_factory.mktemp("repro")
    model = make_tiny_pipeline(root / "model", family="sd3", seed=0)
    rows = [{"prompt": p, "data_source": "brightness"} for p in ["a photo of a cat", "a red house", "a dark sky"]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return {"root": root, "model": model}


def _run(setup: dict, name: str, seed: int, extra: list[str]) -> list[dict]:
    root = setup["root"]
    run = root / name
    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(setup["model"], root / "train.jsonl", run, batch=3, n=4, lr=4e-3, steps=STEPS,
                             micro_batch=12, sampler_steps=4),
        "rollout.max_batch_size=5", "rollout.diffusers.max_batch_size=3", f"trainer.seed={seed}", *extra,
    ])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not any(t in k for t in VOLATILE)} for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.mark.parametrize("algo, extra", [
    ("flow_grpo", ["trainer.flow_grpo.sde_window_size=2", "trainer.flow_grpo.sde_window_start=1",
                   "trainer.flow_grpo.sde_window_random=true"]),
    ("dance_grpo", ["trainer.flow_grpo.dance_grpo.enable=true", "trainer.flow_grpo.dance_grpo.timestep_fraction=0.5"]),
    ("diffusion_nft", ["trainer.flow_grpo.algorithm=diffusion_nft", "trainer.flow_grpo.noise_level=0.0",
                       "trainer.flow_grpo.sde_window_size=1", "actor.ppo_epochs=2"]),
])
def test_same_seed_same_run_other_seed_other_run(setup, algo, extra):
    first = _run(setup, f"{algo}-a", 7, extra)
    again = _run(setup, f"{algo}-b", 7, extra)
    other = _run(setup, f"{algo}-c", 8, extra)
    assert first == again, "two runs with trainer.seed=7 differ"
    scores = [r["critic/score/mean"] for r in first]
    assert len(set(scores)) == STEPS, f"every step samples new images: {scores}"
    assert all(a["critic/score/mean"] != b["critic/score/mean"] for a, b in zip(first, other)), \
        "trainer.seed=8 reproduced seed 7's rewards"
