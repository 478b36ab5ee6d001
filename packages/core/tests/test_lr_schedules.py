"""LR schedules by transformers' names; the old ``constant``/``cosine`` configs keep their exact LRs."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.config.roles import OptimConfig
from polyrl.errors import ConfigError
from polyrl.lr_schedules import LR_SCHEDULES, build_lr_scheduler, lr_factor


def _old_factor(name: str, warmup_steps: int, warmup_ratio: float, min_lr_ratio: float, total_steps: int):
    """The hand-written schedule of polyrl-engine-fsdp 0.1 (``optim.lr_scheduler`` constant | cosine), verbatim."""
    total = max(1, total_steps)
    warmup = warmup_steps or int(warmup_ratio * total)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


@pytest.mark.parametrize(("name", "min_lr_ratio"), [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1)])
@pytest.mark.parametrize(("warmup_steps", "warmup_ratio"), [(0, 0.0), (10, 0.0), (0, 0.1), (1, 0.0), (3, 0.5)])
@pytest.mark.parametrize("total", [1, 7, 40])
def test_old_names_give_the_old_lrs_exactly(name, warmup_steps, warmup_ratio, min_lr_ratio, total):
    old = _old_factor(name, warmup_steps, warmup_ratio, min_lr_ratio, total)
    optim = OptimConfig(lr=1e-3, lr_scheduler_type=name, lr_warmup_steps=warmup_steps or -1,
                        lr_warmup_steps_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio, total_steps=total)
    new = lr_factor(optim, "actor.optim")
    assert [new(s) for s in range(total + 3)] == [old(s) for s in range(total + 3)]  # bit-exact, past the end too


def test_scheduler_steps_the_optimizer_lr():
    """What the quickstart's SFT config (cosine, 10 warmup steps) gives step by step on a real optimizer."""
    optim = OptimConfig(lr=1e-3, lr_scheduler_type="cosine", lr_warmup_steps=10, total_steps=30)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=optim.lr)
    sched = build_lr_scheduler(opt, optim, "actor.optim")
    old = _old_factor("cosine", 10, 0.0, 0.0, 30)
    lrs = []
    for _ in range(30):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == [optim.lr * old(s) for s in range(30)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3) and lrs[-1] < 1e-5


def test_transformers_schedules_by_name():
    def lrs(**kw):
        f = lr_factor(OptimConfig(lr=1.0, total_steps=10, **kw), "actor.optim")
        return [f(s) for s in range(10)]

    assert lrs(lr_scheduler_type="linear") == pytest.approx([1 - s / 10 for s in range(10)])
    assert lrs(lr_scheduler_type="linear", lr_warmup_steps=2)[:3] == pytest.approx([0.5, 1.0, 1.0])
    restarts = lrs(lr_scheduler_type="cosine_with_restarts", num_cycles=2)
    assert restarts[5] == pytest.approx(1.0) and restarts[4] < 0.2  # back to full LR halfway
    poly = lrs(lr_scheduler_type="polynomial", min_lr_ratio=0.1, lr_scheduler_kwargs={"power": 2.0})
    assert poly[0] == 1.0 and poly[5] == pytest.approx(0.1 + 0.9 * 0.25)
    assert lrs(lr_scheduler_type="inverse_sqrt", lr_warmup_steps=4)[8] == pytest.approx(1 / math.sqrt(2))
    wsd = lrs(lr_scheduler_type="warmup_stable_decay", lr_warmup_steps=2, lr_scheduler_kwargs={"num_decay_steps": 4})
    assert wsd[:6] == pytest.approx([0.5, 1, 1, 1, 1, 1]) and wsd[9] < wsd[7] < 1
    assert lrs(warmup_style="cosine") == lrs(lr_scheduler_type="cosine")  # verl's older key


def test_unknown_or_misused_keys_are_config_errors():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr_scheduler_type='cosin'.*cosine_with_restarts"):
        lr_factor(OptimConfig(lr_scheduler_type="cosin"), "actor.optim")
    with pytest.raises(ConfigError, match=r"critic\.optim\.warmup_style='nope'"):
        lr_factor(OptimConfig(warmup_style="nope"), "critic.optim")
    with pytest.raises(ConfigError, match=r"actor\.optim\.min_lr_ratio=0\.1 has no effect on the 'linear'"):
        lr_factor(OptimConfig(lr_scheduler_type="linear", min_lr_ratio=0.1), "actor.optim")
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr_scheduler_kwargs.*warmup_stable_decay"):
        lr_factor(OptimConfig(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"bogus": 1}),
                  "actor.optim")
    assert set(LR_SCHEDULES) >= {"constant", "cosine", "linear", "polynomial", "inverse_sqrt"}
