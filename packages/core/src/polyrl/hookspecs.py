"""The hooks a polyrl plugin may implement.

Every hook is a *registration* hook: it is called once per plugin manager with a
``register`` callback, and the plugin calls ``register(name, obj, **metadata)``
for each thing it provides. ``obj`` may be the object itself or an import string
``"package.module:attr"`` loaded on first use, so heavy backends (vLLM,
megatron.core, diffusers) are imported only when a run selects them.

A hook implementation may accept a subset of a hook's arguments (pluggy's rule),
so new arguments can be added later without breaking plugins. Hooks are only
ever added, never renamed. Metadata every kind understands:

* ``aliases``: other names for the same object (``register("fsdp", ..., aliases=["fsdp2"])``).
* ``description``: one line shown by ``polyrl plugins``.

Every hook here is documented in ``docs/plugins/hooks.md``; a test enforces it.
"""

from __future__ import annotations

import pluggy

from polyrl.registry import RegisterFn

PROJECT_NAME = "polyrl"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_engines(register: RegisterFn) -> None:
    """Register training engines (kind ``engine``).

    ``obj`` is a factory ``(config, *, role, model_type, platform) -> Engine``
    (see :class:`polyrl.protocols.Engine`), usually the engine class.
    """


@hookspec
def register_rollouts(register: RegisterFn) -> None:
    """Register rollouts (kind ``rollout``).

    ``obj`` is a factory ``(config, *, model_path, tokenizer, platform) -> Rollout``.
    """


@hookspec
def register_reward_managers(register: RegisterFn) -> None:
    """Register reward managers (kind ``reward_manager``).

    ``obj`` is a factory ``(*, tokenizer, compute_score, config) -> RewardManager``; ``config`` is the
    run's ``reward`` block (:class:`polyrl.rewards.RewardConfig`).
    """


@hookspec
def register_reward_functions(register: RegisterFn) -> None:
    """Register reward functions (kind ``reward_function``) with verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` signature.

    Metadata ``data_sources=[...]`` makes the function the default for those data sources.
    """


@hookspec
def register_agent_loops(register: RegisterFn) -> None:
    """Register agent loops (kind ``agent_loop``); a dataset row selects one by ``agent_name``.

    ``obj`` is a factory ``(*, tokenizer, config, tools) -> AgentLoop``.
    """


@hookspec
def register_tools(register: RegisterFn) -> None:
    """Register tools agent loops can call (kind ``tool``). ``obj`` is a factory ``(config) -> Tool``."""


@hookspec
def register_tool_parsers(register: RegisterFn) -> None:
    """Register tool-call parsers (kind ``tool_parser``); ``agent.tool_parser`` selects one.

    ``obj`` is a zero-argument factory returning an object with ``parse(text) -> ParsedTurn``
    (:class:`polyrl.tools.parsers.ToolCallParser`); malformed calls go to ``ParsedTurn.errors``, never raise.
    """


@hookspec
def register_advantage_estimators(register: RegisterFn) -> None:
    """Register advantage estimators (kind ``advantage_estimator``), verl's signature
    ``fn(token_level_rewards, response_mask, index=None, config=None, **kw) -> (advantages, returns)``.

    Metadata ``needs_values=True`` marks an estimator that needs a critic's values (like ``gae``);
    ``needs_fields=[...]`` names the batch fields it cannot run without (``sum_pi_squared``: the trainer asks
    the actor's engine for it; ``reward_baselines``: only a trainer declaring it in ``provides_fields`` makes it),
    checked before any worker starts.
    """


@hookspec
def register_policy_losses(register: RegisterFn) -> None:
    """Register policy losses (kind ``policy_loss``), verl's signature
    ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs=None)``.
    """


@hookspec
def register_platforms(register: RegisterFn) -> None:
    """Register device platforms (kind ``platform``). ``obj`` is a zero-argument factory
    returning a :class:`polyrl.protocols.Platform`. Metadata ``priority`` (int) orders
    auto-detection: the available platform with the highest priority wins.
    """


@hookspec
def register_config_schemas(register: RegisterFn) -> None:
    """Register config schemas (kind ``config_schema``).

    ``name`` is the dotted config path the schema validates, e.g. ``"engine.fsdp"``
    for the ``fsdp:`` block of a role whose ``engine`` is ``fsdp``, or
    ``"rollout.vllm"``; ``obj`` is a dataclass usable as an OmegaConf structured config.
    """


@hookspec
def register_trainers(register: RegisterFn) -> None:
    """Register trainers (kind ``trainer``): ``obj`` is a factory ``(config, *, manifest, plugins) -> Trainer``
    whose ``fit()`` runs the training loop; one registered as ``ppo`` replaces the built-in PPO/GRPO trainer.

    Metadata ``provides_fields=[...]``: batch fields the trainer produces for estimators that need them
    (named in the error when a run's estimator needs one its trainer does not make).
    """


@hookspec
def register_datasets(register: RegisterFn) -> None:
    """Register dataset loaders (kind ``dataset``): ``obj`` is ``(path, *, config) -> list[dict]``
    returning rows in verl's format. Metadata ``suffixes=[".parquet"]`` picks a loader by file name.
    """


@hookspec
def register_judge_parsers(register: RegisterFn) -> None:
    """Register judge-output parsers (kind ``judge_parser``) for generative reward models;
    ``reward_model.judge.parser`` selects one.

    ``obj`` is a callable ``parse(text: str) -> float | None``: the score the judge's verdict states, or ``None``
    when it states none (the sample then gets ``reward_model.judge.fallback_score`` and counts as a failure).
    It must not raise for any text.
    """


@hookspec
def register_sandboxes(register: RegisterFn) -> None:
    """Register code sandboxes (kind ``sandbox``) that code-execution rewards run programs in;
    ``reward.sandbox`` selects one.

    ``obj`` is a factory ``(config) -> CodeSandbox`` taking the run's ``reward`` block
    (:class:`polyrl.rewards.RewardConfig`); see :class:`polyrl.sandboxes.CodeSandbox`.
    """


@hookspec
def register_environments(register: RegisterFn) -> None:
    """Register environments (kind ``environment``) the ``stepwise`` agent loop plays; a dataset row selects one
    by ``extra_info.env``.

    ``obj`` is a factory ``(config) -> Environment`` taking the row's ``extra_info.env_kwargs`` mapping; it is
    called once per trajectory (see :class:`polyrl.protocols.Environment`).
    """
