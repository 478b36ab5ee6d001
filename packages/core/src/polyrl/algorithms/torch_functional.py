"""Tensor helpers that losses and estimators share, with the names of verl's ``verl.utils.torch_functional``.

A verl user's ``import verl.utils.torch_functional as verl_F`` becomes
``import polyrl.algorithms.torch_functional as verl_F``.

Every masked reduction *selects* the entries where ``mask`` is non-zero
(``torch.where``) instead of multiplying by the mask: a NaN or inf in padding
(``mask == 0``) never reaches the result, while ``NaN * 0`` would. A
fractional mask still weights the entries it selects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "calculate_sum_pi_squared_from_logits",
    "clip_by_value",
    "entropy_from_logits",
    "get_response_mask",
    "logprobs_from_logits",
    "masked_mean",
    "masked_select_zero",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

Dim = int | tuple[int, ...] | None


def masked_select_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is non-zero, 0 elsewhere (whatever ``values`` holds there, NaN included)."""
    return torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _pick_dim(axis: Dim, dim: Dim) -> Dim:
    if axis is not None and dim is not None and axis != dim:
        raise ValueError(f"give the reduction dimension once: axis={axis} and dim={dim} differ")
    return axis if axis is not None else dim


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Dim = None, *, dim: Dim = None) -> torch.Tensor:
    """Sum of ``values * mask`` over the entries where ``mask`` is non-zero (all, or along ``axis``/``dim``)."""
    reduce = _pick_dim(axis, dim)
    selected = masked_select_zero(values * mask, mask)
    return selected.sum() if reduce is None else selected.sum(dim=reduce)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Dim = None, *, dim: Dim = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 (not NaN) where the mask is empty."""
    reduce = _pick_dim(axis, dim)
    total = mask.sum() if reduce is None else mask.sum(dim=reduce)
    return masked_sum(values, mask, reduce) / total.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries, Bessel-corrected like verl (no correction for a single entry)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean and unit variance over the masked entries (``rsqrt(var + 1e-8)``, as verl).

    Padding entries come back as 0, not as whitened padding.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return masked_select_zero(whitened, mask)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor | float, tensor_max: torch.Tensor | float) -> torch.Tensor:
    """``x`` clamped to ``[tensor_min, tensor_max]``, which may be tensors broadcastable to ``x``."""
    low = torch.as_tensor(tensor_min, dtype=x.dtype, device=x.device)
    high = torch.as_tensor(tensor_max, dtype=x.dtype, device=x.device)
    return torch.maximum(torch.minimum(x, high), low)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension (computed in float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``log softmax(logits)[labels]`` over the last dimension (float32 for half-precision logits).

    ``inplace_backward`` is accepted for verl's signature; this implementation has no fused kernel.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v pi_v^2`` per position (the optimal-token-baseline estimators' input), from logits, in the logits' dtype
    (as verl's). 16-bit logits are summed in float32 first (a bf16 logsumexp over a vocabulary loses digits)."""
    work = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    out = torch.exp(torch.logsumexp(2.0 * work, dim=-1) - 2.0 * torch.logsumexp(work, dim=-1))
    return out.to(logits.dtype)


def get_response_mask(response_id: torch.Tensor, eos_token: int | list[int] = 2,
                      dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """1 up to and including the first EOS token of each row, 0 after it."""
    eos = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    is_eos = torch.isin(response_id, torch.tensor(eos, device=response_id.device))
    # tokens strictly after the first EOS: the running count of EOS before them is > 0
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).to(dtype)
