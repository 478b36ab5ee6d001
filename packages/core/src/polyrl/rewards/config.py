"""The ``reward`` block of a run's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CustomRewardFunctionConfig:
    """verl's ``custom_reward_function`` spelling of ``reward.function``: ``path`` (a .py file) and ``name``
    (the function in it; default ``compute_score``)."""

    #: The Python file that defines the reward function.
    path: str | None = None
    #: The function in it (``null``: ``compute_score``).
    name: str | None = None


@dataclass
class CodeRewardConfig:
    """The ``code`` reward: a response's program run against its row's tests (docs/reward_models.md)."""

    #: Seconds each test may run (wall time; the CPU limit is the same, rounded up).
    timeout_s: float = 5.0
    #: Memory each test may use, MiB.
    memory_mb: int = 1024
    #: Score the fraction of tests passed (else 1 only when every test passes, 0 otherwise).
    partial_credit: bool = False
    #: Run at most this many tests of a row (0: all).
    max_tests: int = 0
    #: The program's language (the ``local`` sandbox runs Python only).
    language: str = "python"
    #: The ``local`` sandbox: ``namespaces`` (no network, no host files; docs/security.md) or ``none`` (limits
    #: only: NOT a security boundary).
    isolation: str = "namespaces"


@dataclass
class SandboxFusionConfig:
    """A SandboxFusion server (``reward.sandbox: sandbox_fusion``; verl's ``reward_model.sandbox_fusion``)."""

    #: Its ``run_code`` endpoint (``http://127.0.0.1:8080/run_code``) or base URL.
    url: str = ""
    #: Memory each program may use, MiB (the request's ``memory_limit_MB``).
    memory_limit_mb: int = 1024
    #: Seconds an HTTP request may take beyond the program's own time limits.
    request_timeout_s: float = 30.0
    #: Further tries of a request answered 502/503/504 or whose connection was refused or reset.
    retries: int = 2
    #: Seconds the start-up check (``print(1)``) waits for the server.
    check_timeout_s: float = 10.0
    #: Requests in flight to the server at once (verl's ``max_concurrent``); the programs of a run never exceed
    #: ``reward.num_workers`` either, so the cap is the smaller of the two (0: ``reward.num_workers`` alone).
    #: Default 64, verl's.
    max_concurrent: int = 64


@dataclass
class CombineConfig:
    """How the reward components of a sample become its score (docs/reward_models.md, "Combining").

    Components: ``rule`` (the reward function, through ``reward.manager``) and the reward model
    (``reward_model.name``, default ``rm``). With no weights, the reward model alone scores when one is
    enabled, else the reward function alone (and then nothing here applies).
    """

    #: ``sum`` (weighted sum of the components in ``weights``), ``gate`` (the weighted sum only where the ``gate``
    #: component is above ``gate_threshold``; elsewhere the gate's own weighted score) or ``function``.
    mode: str = "sum"
    #: Component -> weight (``{rule: 1.0, rm: 0.5}``). Empty: every component of the run, weight 1, in ``gate``
    #: mode; the reward model alone (or the rule alone) in ``sum`` mode.
    weights: dict[str, float] = field(default_factory=dict)
    #: ``gate`` mode: the component that must pass.
    gate: str = "rule"
    #: ``gate`` mode: the gate passes where its score is above this.
    gate_threshold: float = 0.0
    #: ``function`` mode: ``path/to/file.py:fn`` called as ``fn(scores, data_source, extra_info)`` with
    #: ``scores`` the sample's ``{component: score}``; returns the score.
    function: str = ""
    #: Per data source, a block of the keys above (``{gsm8k: {weights: {rule: 1.0}}, chat: {weights: {rm: 1.0}}}``);
    #: a data source not listed uses the keys above.
    per_data_source: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """How samples are scored.

    ``function``: empty (pick by ``data_source``), a registered reward function
    name, or ``path/to/file.py:function`` with verl's ``compute_score`` signature.
    """

    #: Reward manager: ``naive`` (one call per sample), ``batch`` (one call for the batch), ``dapo``.
    manager: str = "naive"
    #: Empty (the function registered for each row's ``data_source``), a registered reward function's name, or
    #: ``path/to/file.py:function`` (verl's ``compute_score`` signature).
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
    #: Length of the buffer zone before the length budget (tokens): a response inside it is penalised in
    #: proportion to how far it reaches.
    overlong_buffer_len: int = 16
    #: The penalty at the end of the buffer (subtracted from the score).
    overlong_penalty_factor: float = 1.0
    #: Response length budget used by the overlong penalty (0: the batch's response width).
    max_response_length: int = 0
    #: Stop the run when every sample's reward call failed (``reward/all_failed``) this many steps in a row; the
    #: last checkpoint stays as it was (0: never stop).
    max_failed_steps: int = 3
    #: How the reward function and the reward model combine into a sample's score.
    combine: CombineConfig = field(default_factory=CombineConfig)
    #: Where code rewards run programs: a registered sandbox (``local``, ``sandbox_fusion``) or ``auto``
    #: (``sandbox_fusion`` when ``sandbox_fusion.url`` is set, else ``local``).
    sandbox: str = "auto"
    #: The ``code`` reward's tests: time and memory per test, partial credit.
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    #: The SandboxFusion server (``reward.sandbox: sandbox_fusion``).
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
