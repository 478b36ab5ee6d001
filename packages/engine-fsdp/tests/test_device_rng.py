"""A resumed run draws from the device generator what an uninterrupted run would: the engine saves and
restores it through its platform (``rng_state`` / ``set_rng_state``), never through ``torch.cuda``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.platforms import CPUPlatform

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, loss_fn, make_engine  # noqa: E402


class SeparateGeneratorPlatform(CPUPlatform):
    """CPU compute, plus a generator of its own standing in for an accelerator's: like a CUDA or NPU
    generator, it is reachable only through the platform, so only the platform calls can restore it."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(1234)

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def draws(self, n: int = 3) -> list[torch.Tensor]:
        return [torch.rand(5, generator=self.generator) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


def test_resume_restores_the_device_generator_through_the_platform(model_dir, tmp_path):
    platform = SeparateGeneratorPlatform()
    engine = make_engine(str(model_dir), platform=platform)
    engine.train_batch(batch(), loss_fn)
    platform.draws(2)  # the run used its device generator before the checkpoint
    engine.save_checkpoint(str(tmp_path / "ck"))
    uninterrupted = platform.draws()

    fresh = SeparateGeneratorPlatform()
    assert not torch.equal(fresh.draws()[0], uninterrupted[0]), "a fresh generator must differ, or this proves nothing"
    resumed = SeparateGeneratorPlatform()
    make_engine(str(model_dir), platform=resumed).load_checkpoint(str(tmp_path / "ck"))
    for got, want in zip(resumed.draws(), uninterrupted):
        assert torch.equal(got, want)


def test_state_from_another_device_type_is_not_forced_on_this_one(model_dir, tmp_path, caplog):
    engine = make_engine(str(model_dir), platform=SeparateGeneratorPlatform())
    engine.save_checkpoint(str(tmp_path / "ck"))

    class OtherDevice(SeparateGeneratorPlatform):
        device_type = "meta"  # stands for "not the device the checkpoint was written on"

    other = OtherDevice()
    before = other.rng_state().clone()
    make_engine(str(model_dir), platform=other).load_checkpoint(str(tmp_path / "ck"))
    assert torch.equal(other.rng_state(), before)
    assert "device RNG not restored" in caplog.text
