"""Checks every rollout applies to its requests before generating."""

from __future__ import annotations

from collections.abc import Sequence

from polyrl.protocols import GenerationRequest


def check_model_length(requests: Sequence[GenerationRequest], max_model_len: int, what: str = "the model length") -> None:
    """Raise ``ValueError`` naming the first request whose prompt plus ``max_new_tokens`` exceeds ``max_model_len``."""
    for i, req in enumerate(requests):
        total = len(req.prompt_ids) + req.sampling_params.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"request {req.request_id or i}: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.sampling_params.max_new_tokens}) = {total} exceeds {what} {max_model_len}"
            )
