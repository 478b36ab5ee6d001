"""The ``reward`` block of a run's config."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CustomRewardFunctionConfig:
    """verl's ``custom_reward_function`` spelling of ``reward.function``: ``path`` (a .py file) and ``name``
    (the function in it; default ``compute_score``)."""

    path: str | None = None
    name: str | None = None


@dataclass
class RewardConfig:
    """How samples are scored.

    ``function``: empty (pick by ``data_source``), a registered reward function
    name, or ``path/to/file.py:function`` with verl's ``compute_score`` signature.
    """

    #: Reward manager: ``naive`` (one call per sample), ``batch`` (one call for the batch), ``dapo``.
    manager: str = "naive"
    function: str = ""
    #: verl's spelling (``reward.custom_reward_function.path``/``.name``), accepted beside ``function``;
    #: giving both is an error unless they name the same function.
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    #: Score given to a sample whose reward function raised, timed out, or returned anything but a finite
    #: number (or a dict with a finite ``score``); each such sample counts in ``reward/failures``.
    fallback_score: float = 0.0
    #: Seconds one reward call may take before its sample gets ``fallback_score`` (0: no limit).
    timeout_s: float = 60.0
    #: Threads that run reward calls concurrently, off the driver's main thread (helps slow or remote
    #: rewards). 0 calls the function in the main thread, one sample after another, with no timeout
    #: (for reward functions that use signals).
    num_workers: int = 4
    #: DAPO overlong penalty: on, buffer length (tokens) and penalty factor.
    overlong_buffer_enable: bool = False
    overlong_buffer_len: int = 16
    overlong_penalty_factor: float = 1.0
    #: Response length budget used by the overlong penalty (0: the batch's response width).
    max_response_length: int = 0
    #: Stop the run when every sample's reward call failed (``reward/all_failed``) this many steps in a row; the
    #: last checkpoint stays as it was (0: never stop).
    max_failed_steps: int = 3
