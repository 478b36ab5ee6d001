"""Learning-rate schedules by name, from ``transformers``' own (``transformers.get_scheduler``).

An engine calls :func:`build_lr_scheduler` with its role's ``optim`` block (verl's key names):

```yaml
actor:
  optim:
    lr: 1.0e-6
    lr_scheduler_type: cosine     # constant (default), linear, cosine, cosine_with_restarts, polynomial, ...
    lr_warmup_steps: -1           # negative: use lr_warmup_steps_ratio * total_steps
    lr_warmup_steps_ratio: 0.05
    min_lr_ratio: 0.1             # the floor of cosine / polynomial / warmup_stable_decay, a fraction of lr
    num_cycles: null              # cosine: 0.5 (a half wave), cosine_with_restarts: 1
    lr_scheduler_kwargs: {}       # anything else the transformers schedule takes (power, num_decay_steps, ...)
```

Two conventions differ from ``transformers`` and follow verl (and polyrl's earlier releases):

- ``constant`` warms up too (it is ``constant_with_warmup``), and ``cosine`` decays to ``min_lr_ratio``
  (it is ``cosine_with_min_lr``).
- Warmup is linear from ``lr / warmup`` at the first step to the full ``lr`` at the last warmup step (no
  optimizer step runs at ``lr = 0``); after ``total_steps`` the schedule keeps its final value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyrl.errors import ConfigError

#: schedule name -> the ``transformers`` SchedulerType it uses
LR_SCHEDULES: dict[str, str] = {
    "constant": "constant_with_warmup",
    "constant_with_warmup": "constant_with_warmup",
    "linear": "linear",
    "cosine": "cosine_with_min_lr",
    "cosine_with_min_lr": "cosine_with_min_lr",
    "cosine_warmup_with_min_lr": "cosine_warmup_with_min_lr",
    "cosine_with_restarts": "cosine_with_restarts",
    "polynomial": "polynomial",
    "inverse_sqrt": "inverse_sqrt",
    "warmup_stable_decay": "warmup_stable_decay",
}
_USES_MIN_LR = {"cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "polynomial"}
_USES_CYCLES = {"cosine_with_min_lr", "cosine_warmup_with_min_lr", "cosine_with_restarts", "warmup_stable_decay"}


def schedule_name(optim: Any, key: str) -> str:
    """The schedule ``optim`` selects (``warmup_style``, verl's older key, wins when set), checked."""
    field = "warmup_style" if getattr(optim, "warmup_style", None) else "lr_scheduler_type"
    name = getattr(optim, field)
    if name not in LR_SCHEDULES:
        raise ConfigError(f"{key}.{field}={name!r} is not a learning-rate schedule; choose one of "
                          f"{', '.join(LR_SCHEDULES)}")
    return name


def warmup_steps(optim: Any, total: int) -> int:
    """``lr_warmup_steps``, or (when negative) ``lr_warmup_steps_ratio`` of ``total``."""
    return optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total)


def lr_factor(optim: Any, key: str) -> Callable[[int], float]:
    """The multiplier of ``optim.lr`` at each optimizer step (0-based), per :mod:`polyrl.lr_schedules`."""
    import torch
    from transformers import get_scheduler

    name = schedule_name(optim, key)
    hf_name = LR_SCHEDULES[name]
    total = max(1, optim.total_steps)
    warmup = warmup_steps(optim, total)
    kwargs = dict(optim.lr_scheduler_kwargs or {})
    if optim.min_lr_ratio and hf_name not in _USES_MIN_LR:
        raise ConfigError(f"{key}.min_lr_ratio={optim.min_lr_ratio} has no effect on the {name!r} schedule; "
                          f"it applies to {', '.join(sorted(_USES_MIN_LR))}")
    if hf_name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        kwargs.setdefault("min_lr_rate", optim.min_lr_ratio)
    elif hf_name == "warmup_stable_decay":
        kwargs.setdefault("min_lr_ratio", optim.min_lr_ratio)
    elif hf_name == "polynomial" and optim.min_lr_ratio:
        kwargs.setdefault("lr_end", optim.lr * optim.min_lr_ratio)
    if optim.num_cycles is not None:
        if hf_name not in _USES_CYCLES:
            raise ConfigError(f"{key}.num_cycles={optim.num_cycles} has no effect on the {name!r} schedule; "
                              f"it applies to {', '.join(sorted(_USES_CYCLES))}")
        kwargs.setdefault("num_cycles", int(optim.num_cycles) if hf_name == "cosine_with_restarts"
                          else optim.num_cycles)
    elif hf_name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        kwargs.setdefault("num_cycles", 0.5)
    if hf_name == "constant_with_warmup" and optim.lr_scheduler_kwargs:
        raise ConfigError(f"{key}.lr_scheduler_kwargs: the {name!r} schedule takes none")
    # transformers' schedules are LambdaLRs: build one on a stand-in optimizer and keep its function
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    try:
        hf = get_scheduler(hf_name, probe, num_warmup_steps=warmup, num_training_steps=total,
                           scheduler_specific_kwargs=None if hf_name == "constant_with_warmup" else kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}.lr_scheduler_kwargs={dict(optim.lr_scheduler_kwargs or {})}: the {name!r} "
                          f"schedule (transformers {hf_name}) rejected its arguments: {exc}") from None
    hf_factor = hf.lr_lambdas[0]
    end = max(total, warmup + 1)  # where the decay ends (one step past a warmup longer than the run)

    def factor(step: int) -> float:
        step = min(step, end)
        # warmup ends at full lr on its last step: transformers' warmup, one step ahead
        return hf_factor(step + 1 if step < warmup else step)

    return factor


def build_lr_scheduler(optimizer: Any, optim: Any, key: str) -> Any:
    """A ``torch.optim.lr_scheduler.LambdaLR`` over ``optimizer`` for the ``optim`` block at config key ``key``
    (``actor.optim``). Its state dict holds only the step, as ``LambdaLR``'s does, so checkpoints resume."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(optim, key))
