"""The ``diffusers`` rollout's sleep / wake-up (a colocated run trains while the rollout sleeps): sleep drops the
text-embedding cache, moves the modules off the compute device and empties the platform's allocator cache; wake-up
brings them back and the images are bit-identical. On a CPU the modules already live on the host: what moves is
checked on a GPU (``test_cuda.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import RolloutConfig
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams


class CountingCPUPlatform(CPUPlatform):
    """The CPU platform, counting the calls to ``empty_cache`` (on CPU it has nothing to return)."""

    def __init__(self) -> None:
        self.emptied = 0

    def empty_cache(self) -> None:
        self.emptied += 1
        super().empty_cache()


def _requests():
    return [GenerationRequest([], SamplingParams(n=1, seed=7), request_id=f"g{i // 2}",
                              multi_modal={"prompt": ["a red house", "a dark sky"][i // 2], "train_step": 1})
            for i in range(4)]


def _batch(rollout):
    return collate_images([SimpleNamespace(extra=r.extra) for r in rollout.generate(_requests())])


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_sleep_frees_the_caches_and_wake_up_gives_the_same_images(tmp_path, family):
    from polyrl_diffusion.rollout import DiffusersRollout

    platform = CountingCPUPlatform()
    rollout = DiffusersRollout(
        RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=FlowGRPOConfig(train_steps=4))),
        model_path=str(make_tiny_pipeline(tmp_path / "m", family=family, seed=0)), platform=platform)
    assert rollout.capabilities.sleep
    first = _batch(rollout)
    assert rollout.cached_prompts == 2
    rollout.sleep(1)
    assert rollout.asleep and rollout.cached_prompts == 0 and platform.emptied == 1
    rollout.sleep(1)  # asleep already: nothing more to release
    assert platform.emptied == 1
    rollout.wake_up()
    assert not rollout.asleep
    second = _batch(rollout)
    for key in ("images", "x0", "latents", "next_latents", "rollout_log_probs", "prompt_embeds"):
        assert torch.equal(first[key], second[key]), key
    rollout.sleep(2)
    third = _batch(rollout)  # a generate call wakes a sleeping rollout up first
    assert not rollout.asleep and torch.equal(first["images"], third["images"])
