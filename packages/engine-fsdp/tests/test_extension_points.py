"""FSDPEngine's public extension points: a subclass that trains another kind of model (a linear regression
here; polyrl-diffusion's diffusers transformer in practice) gets sharding, the optimizer, micro-batches and
weight buckets from the engine by overriding only ``load_model``, ``apply_lora``, ``wrap_model`` and
``forward_micro_batch``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig, OptimConfig
from polyrl.errors import ConfigError
from polyrl.platforms import CPUPlatform
from polyrl_engine_fsdp.config import FSDPConfig
from polyrl_engine_fsdp.engine import FSDPEngine, full_tensor


class _Root(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).squeeze(-1)


class _RegressionEngine(FSDPEngine):
    required_fields = ("x", "y", "response_mask")
    config_section = "regression"

    def load_model(self, dtype: torch.dtype) -> nn.Module:
        self.hf_config = {"in_features": 3}
        return nn.Linear(3, 1).to(dtype)

    def apply_lora(self, model: nn.Module, lora) -> nn.Module:
        self.lora_rank_seen = lora.rank
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return _Root(model)

    def forward_micro_batch(self, mb, temperature, compute_entropy):
        return {"pred": self.module(mb["x"].to(self.device))}, mb


def _mse(out, mb, scale):
    loss = ((out["pred"] - mb["y"]) ** 2).sum() / scale.global_batch_size * scale.dp_size
    return loss, {"mse": float(loss.detach())}


def _engine(**kw) -> _RegressionEngine:
    cfg = EngineRoleConfig(model=ModelConfig(path="unused", **kw.pop("model", {})), optim=OptimConfig(lr=0.1),
                           micro_batch_size=3, **kw)
    return _RegressionEngine(cfg, role="actor", platform=CPUPlatform())


def test_a_subclass_trains_its_own_model_through_the_engine():
    engine = _engine()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g)
    data = TensorDict({"x": x, "y": x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3,
                       "response_mask": torch.ones(8, 1)}, batch_size=[8])
    assert [len(r) for r in engine.split_micro_batches(data, False)] == [3, 3, 2]
    first = engine.train_batch(data, _mse)
    for _ in range(60):
        last = engine.train_batch(data, _mse)
    assert last["mse"] < 0.05 * first["mse"] and "actor/grad_norm" in last
    names = [n for bucket in engine.weights_for_rollout(1 << 20) for n, _ in bucket]
    assert names == ["weight", "bias"]  # the root's `model.` prefix is not part of the model's names
    weight = dict(engine.full_parameters())["weight"]
    assert torch.allclose(weight, full_tensor(engine.module.model.weight))
    assert torch.allclose(weight, torch.tensor([[1.0, -2.0, 0.5]]), atol=0.05)
    assert engine.padding_micro_batch(data)["response_mask"].sum() == 0 and engine.rank == 0


def test_options_are_checked_under_the_subclass_section_and_lora_goes_through_its_hook():
    with pytest.raises(ConfigError, match=r"actor\.regression\.param_dtype='bf16' is not a torch dtype"):
        _engine(plugin_config=FSDPConfig(param_dtype="bf16"))
    engine = _engine(model={"lora": LoRAConfig(rank=4)})
    assert engine.lora_rank_seen == 4
