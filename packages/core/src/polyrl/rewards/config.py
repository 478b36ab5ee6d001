"""The ``reward`` block of a run's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    """How samples are scored.

    ``function``: empty (pick by ``data_source``), a registered reward function
    name, or ``path/to/file.py:function`` with verl's ``compute_score`` signature.
    """

    #: Reward manager: ``naive`` (one call per sample), ``batch`` (one call for the batch), ``dapo``.
    manager: str = "naive"
    function: str = ""
    #: Score given to a sample whose reward function raised or returned NaN/inf.
    fallback_score: float = 0.0
    #: DAPO overlong penalty: on, buffer length (tokens) and penalty factor.
    overlong_buffer_enable: bool = False
    overlong_buffer_len: int = 16
    overlong_penalty_factor: float = 1.0
    #: Response length budget used by the overlong penalty (0: the batch's response width).
    max_response_length: int = 0
