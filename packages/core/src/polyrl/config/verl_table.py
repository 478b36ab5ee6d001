"""What each key of verl's trainer config becomes in polyrl: one table, three kinds of entry.

- :class:`Mapped`: the key sets a polyrl key (sometimes through a conversion: verl's ``-1`` for "never",
  a global micro-batch divided by the world size, ``fp32`` -> ``float32``...).
- :class:`Ignored`: accepted with no effect here, and why (``gpu_memory_utilization`` of a reward model that
  polyrl does not start, profiler settings, CUDA-graph tuning...). A run that sets one to something else
  than verl's default says so in one warning.
- :class:`Refused`: a value polyrl cannot honour (a model-based reward, MoE routing replay...); the run stops
  before anything
  starts with one line naming the key and what to do instead. Each refused key has the values that are
  fine (verl's default, usually), so a script that repeats the default still runs.

An entry names one key, or a pattern: ``prefix.*`` is the key and everything under it, ``*`` elsewhere
matches any run of characters. A key takes the entry that names it exactly, else the longest matching
pattern. ``docs/from_verl.md`` holds this table rendered (``python -m polyrl.config.verl_table --write``);
a test checks that every key of verl's ``ppo_trainer`` and ``ppo_megatron_trainer`` trees classifies.
"""

from __future__ import annotations

import fnmatch
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

#: A converter's answer for "leave the polyrl key at its default".
SKIP: Any = object()

#: The roles' verl prefixes and polyrl sections.
ACTOR, REF, ROLLOUT, MODEL = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout",
                              "actor_rollout_ref.model")


class VerlView:
    """The resolved verl tree a converter reads: ``values`` (flat ``key -> value``), ``origins`` (where each
    key's value came from: ``verl default ...``, a file, the command line)."""

    def __init__(self, values: Mapping[str, Any], origins: Mapping[str, str]) -> None:
        self.values, self.origins = dict(values), dict(origins)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (a leaf, or the subtree under it as a dict); ``default`` when absent."""
        if key in self.values:
            return self.values[key]
        prefix = key + "."
        sub = {k[len(prefix):]: v for k, v in self.values.items() if k.startswith(prefix)}
        if not sub:
            return default
        tree: dict = {}
        for k, v in sub.items():
            node = tree
            *parents, leaf = k.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = v
        return tree

    def has(self, key: str) -> bool:
        """Whether the tree holds ``key`` (a leaf or a subtree)."""
        return key in self.values or any(k.startswith(key + ".") for k in self.values)

    def user_set(self, key: str) -> bool:
        """Whether ``key`` (or something under it) got its value from the user rather than verl's defaults."""
        keys = [key] if key in self.values else [k for k in self.values if k.startswith(key + ".")]
        return any(not self.origins.get(k, "verl default").startswith("verl default") for k in keys)

    @property
    def world(self) -> int:
        """Devices of the run: ``trainer.nnodes * trainer.n_gpus_per_node``."""
        return max(1, int(self.get("trainer.nnodes", 1) or 1) * int(self.get("trainer.n_gpus_per_node", 1) or 1))

    def engine(self, prefix: str) -> str:
        """The polyrl engine of a role (``fsdp`` or ``megatron``) from its verl ``strategy``."""
        strategy = self.get(f"{prefix}.strategy") or self.get(f"{ACTOR}.strategy") or "fsdp"
        return _engine(strategy, f"{prefix}.strategy")


Converter = Callable[[Any, VerlView], dict[str, Any]]


@dataclass(frozen=True)
class Mapped:
    """``verl`` sets ``native`` (the text shown in the docs; one polyrl key unless ``convert`` says more)."""

    verl: str
    native: str
    #: ``(value, view) -> {polyrl key: value}``; None: ``{native: value}``. A value of :data:`SKIP` is not set.
    convert: Converter | None = None
    note: str = ""
    #: verl's default is a placeholder (a model path on verl's machines...): polyrl keeps its own default
    #: unless the user set the key.
    placeholder: bool = False
    #: A free-form block: keys verl's tree does not list (added with ``+``) are accepted under it.
    open: bool = False

    def apply(self, value: Any, view: VerlView) -> dict[str, Any]:
        """The polyrl keys this entry sets for ``value``."""
        if self.convert is None:
            return {self.native: value}
        return self.convert(value, view)


@dataclass(frozen=True)
class Ignored:
    """Accepted with no effect in polyrl, for ``reason``."""

    verl: str
    reason: str
    #: A free-form block: keys verl's tree does not list (added with ``+``) are accepted under it.
    open: bool = False


@dataclass(frozen=True)
class Refused:
    """A value other than the ``allowed`` ones stops the run; ``instead`` says what to do."""

    verl: str
    instead: str
    #: Values that are fine (no effect). None: only verl's default (or, for a key verl's tree lacks, null).
    allowed: tuple[Any, ...] | None = None
    #: Text for the docs when ``allowed`` is a condition rather than a list.
    allowed_text: str = ""
    check: Callable[[Any], bool] | None = field(default=None, compare=False)

    def accepts(self, value: Any, default: Any) -> bool:
        """Whether ``value`` is one of the harmless ones."""
        if self.check is not None:
            return self.check(value)
        allowed = self.allowed if self.allowed is not None else (default,)
        return any(_same(value, a) for a in allowed)


Entry = Mapped | Ignored | Refused


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return bool(a == b) and type(a) is type(b) or (a is None and b is None) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        and not isinstance(b, bool) and a == b)


# ---------------------------------------------------------------------------- conversions

_DTYPES = {"fp32": "float32", "float32": "float32", "float": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16", "half": "float16"}


def _dtype(value: Any, key: str) -> str:
    name = str(value).lower().replace("torch.", "")
    if name not in _DTYPES:
        raise ConfigError(f"verl key '{key}'={value!r}: not a dtype polyrl knows (fp32, bf16, fp16 or their torch names)")
    return _DTYPES[name]


def _engine(strategy: Any, key: str) -> str:
    name = str(strategy).lower()
    if name in ("fsdp", "fsdp2", "fsdp_turbo"):  # fsdp_turbo: verl's FSDP2 with its own sharding plan
        return "fsdp"
    if name == "megatron":
        return "megatron"
    raise ConfigError(f"verl key '{key}'={strategy!r}: polyrl's engines are fsdp (verl's fsdp, fsdp2, fsdp_turbo) "
                      "and megatron")


def _to(native: str, fn: Callable[[Any], Any]) -> Converter:
    return lambda v, view: {native: fn(v)}


def _never_if_negative(v: Any) -> int:
    return 0 if v is None or int(v) < 0 else int(v)


def _none_to(default: Any) -> Callable[[Any], Any]:
    return lambda v: default if v is None else v


def _as_list(v: Any) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _micro(prefix: str, native: str, global_key: str, per_gpu_key: str, dynamic_key: str) -> Converter:
    """verl's micro-batch pair: ``*_per_gpu`` as is, else the global count divided by the world size."""

    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        per_gpu, total = view.get(f"{prefix}.{per_gpu_key}"), view.get(f"{prefix}.{global_key}")
        if per_gpu is not None and total is not None:
            raise ConfigError(f"verl keys '{prefix}.{global_key}' and '{prefix}.{per_gpu_key}' are both set; verl "
                              f"takes one of the two: keep '{prefix}.{per_gpu_key}'")
        if per_gpu is not None:
            return {native: int(per_gpu)}
        if total is not None:
            return {native: max(1, int(total) // view.world)}
        return {}

    return convert


def _uses_critic(view: VerlView) -> bool:
    return str(view.get("algorithm.adv_estimator")) == "gae" or bool(view.get("critic.enable"))


def _required_micro(prefix: str, native: str, dynamic_key: str | None) -> Converter:
    """verl refuses to start without a micro-batch size (unless batches are sized by tokens); the critic's
    only matters when a critic runs."""
    base = _micro(prefix, native, "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", dynamic_key or "")

    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        out = base(value, view)
        needed = prefix != "critic" or _uses_critic(view)
        if not out and needed and not (dynamic_key and view.get(f"{prefix}.{dynamic_key}")):
            raise ConfigError(f"verl key '{prefix}.ppo_micro_batch_size_per_gpu' is not set: verl needs it (or "
                              f"'{prefix}.ppo_micro_batch_size', or {prefix}.use_dynamic_bsz=True)")
        return out

    return convert


def _skip(v: Any, view: VerlView) -> dict[str, Any]:
    return {}


def _ref_micro(value: Any, view: VerlView) -> dict[str, Any]:
    per_gpu, total = view.get(f"{REF}.log_prob_micro_batch_size_per_gpu"), view.get(f"{REF}.log_prob_micro_batch_size")
    if per_gpu is not None and total is not None:
        raise ConfigError(f"verl keys '{REF}.log_prob_micro_batch_size' and '{REF}.log_prob_micro_batch_size_per_gpu' "
                          "are both set; verl takes one of the two: keep the _per_gpu one")
    if per_gpu is not None:
        return {"ref.micro_batch_size": int(per_gpu)}
    if total is not None:
        return {"ref.micro_batch_size": max(1, int(total) // view.world)}
    return {}


def _truncation(value: Any, view: VerlView) -> dict[str, Any]:
    if view.get("data.filter_overlong_prompts"):
        return {"data.truncation": "filter"}
    mode = str(value)
    if mode not in ("error", "left", "right"):
        raise ConfigError(f"verl key 'data.truncation'={mode!r}: polyrl truncates prompts 'left' or 'right', or "
                          "refuses them ('error'); data.filter_overlong_prompts=True drops them")
    return {"data.truncation": mode}


def _loggers(value: Any, view: VerlView) -> dict[str, Any]:
    names = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow",
             "file": "jsonl", "jsonl": "jsonl"}
    out = []
    for name in _as_list(value):
        key = str(name).lower()
        if key not in names:
            raise ConfigError(f"verl key 'trainer.logger': logger {name!r} is not one of polyrl's (console, wandb, "
                              "tensorboard, mlflow; verl's 'file' is polyrl's jsonl): drop it")
        if names[key] not in out:
            out.append(names[key])
    if "jsonl" not in out:  # the run directory's metrics.jsonl (plots, `polyrl view`, resume)
        out.append("jsonl")
    return {"trainer.logger": out}


def _resume(value: Any, view: VerlView) -> dict[str, Any]:
    mode = str(value)
    if mode in ("auto", "disable"):
        return {"trainer.resume": mode}
    if mode == "resume_path":
        path = view.get("trainer.resume_from_path")
        if not path:
            raise ConfigError("verl key 'trainer.resume_mode'=resume_path needs trainer.resume_from_path")
        return {"trainer.resume": str(path)}
    raise ConfigError(f"verl key 'trainer.resume_mode'={mode!r}: choose auto, disable or resume_path")


def _layout(value: Any, view: VerlView) -> dict[str, Any]:
    return {"trainer.n_workers": view.world}


def _val_temperature(value: Any, view: VerlView) -> dict[str, Any]:
    sample = view.get(f"{ROLLOUT}.val_kwargs.do_sample", False)
    return {"rollout.val_temperature": float(value) if sample else 0.0}


def _temperature(value: Any, view: VerlView) -> dict[str, Any]:
    sample = view.get(f"{ROLLOUT}.do_sample", True)
    return {"rollout.temperature": float(value) if sample else 0.0}


def _rollout_opt(vllm: str | None, sglang: str | None, fn: Callable[[Any], Any] = lambda v: v, *,
                 hf: str | None = None) -> Converter:
    """A rollout engine option: set on the block of the rollout in use (``rollout.vllm`` / ``rollout.sglang``), or
    for the ``hf`` rollout on the ``rollout`` block itself."""

    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        name = str(view.get(f"{ROLLOUT}.name"))
        if name == "hf":
            return {f"rollout.{hf}": fn(value)} if hf else {}
        target = {"vllm": vllm, "sglang": sglang}.get(name)
        if target is None:
            return {}
        return {f"rollout.{name}.{target}": fn(value)}

    return convert


def _engine_kwargs(which: str) -> Converter:
    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        if str(view.get(f"{ROLLOUT}.name")) != which or not value:
            return {}
        kwargs = dict(value)
        out: dict[str, Any] = {}
        if which == "sglang" and "attention_backend" in kwargs:
            out["rollout.sglang.attention_backend"] = kwargs.pop("attention_backend")
        if kwargs:
            out[f"rollout.{which}.engine_kwargs"] = kwargs
        return out

    return convert


def _plugin(prefix: str, section: str, engine: str, option: str, fn: Callable[[Any], Any] = lambda v: v) -> Converter:
    """An engine option, set on the role's plugin block when the role runs that engine."""

    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        role_prefix = prefix if prefix != REF else ACTOR
        if view.engine(role_prefix) != engine:
            return {}
        return {f"{section}.{engine}.{option}": fn(value)}

    return convert


def _sequence_parallel(prefix: str, section: str) -> Converter:
    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        if view.engine(prefix if prefix != REF else ACTOR) != "megatron":
            return {}
        tp = int(view.get(f"{prefix}.megatron.tensor_model_parallel_size", 1) or 1)
        return {f"{section}.megatron.sequence_parallel": bool(value) and tp > 1}  # verl turns it off at TP 1

    return convert


def _min_lr(prefix: str, section: str) -> Converter:
    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        lr = float(view.get(f"{prefix}.optim.lr") or 0.0)
        if not value or not lr:
            return {}
        return {f"{section}.optim.min_lr_ratio": float(value) / lr}

    return convert


def _grad_clip(prefix: str, section: str) -> Converter:
    """verl's ``grad_clip`` (role level, older) and ``optim.clip_grad``: the one the user set wins."""

    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        role, optim = f"{prefix}.grad_clip", f"{prefix}.optim.clip_grad"
        chosen = role if view.has(role) and view.user_set(role) else optim
        return {f"{section}.optim.grad_clip": float(view.get(chosen, value))}

    return convert


def _agent_loop(value: Any, view: VerlView) -> dict[str, Any]:
    name = {"single_turn_agent": "single_turn", "tool_agent": "tool_agent"}.get(str(value), str(value))
    if view.get(f"{ROLLOUT}.multi_turn.enable"):
        name = "tool_agent" if name == "single_turn" else name
    return {"agent.default_loop": name}


def _reward_manager(value: Any, view: VerlView) -> dict[str, Any]:
    return {"reward.manager": str(value)}


#: polyrl's own fields of ``actor.policy_loss`` (others a verl config adds go to its ``extra``).
_POLICY_LOSS_FIELDS = ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
                       "tis_imp_ratio_cap", "dro_beta", "rollout_correction", "extra")


def _policy_loss(value: Any, view: VerlView) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, x in (value or {}).items():
        if key == "_target_":
            continue
        out[f"actor.policy_loss.{key}" if key in _POLICY_LOSS_FIELDS else f"actor.policy_loss.extra.{key}"] = x
    return out


def _filter_groups(value: Any, view: VerlView) -> dict[str, Any]:
    cfg = dict(value or {})
    out: dict[str, Any] = {}
    if "enable" in cfg:
        out["algorithm.filter_groups.enable"] = bool(cfg["enable"])
    if cfg.get("metric") is not None:
        out["algorithm.filter_groups.metric"] = cfg["metric"]
    if cfg.get("max_num_gen_batches") is not None and view.user_set("algorithm.filter_groups.max_num_gen_batches"):
        out["algorithm.filter_groups.max_num_gen_batches"] = int(cfg["max_num_gen_batches"])
    return out


def _reward_kwargs(value: Any, view: VerlView, block: str = "reward_model") -> dict[str, Any]:
    kwargs = dict(value or {})
    out: dict[str, Any] = {}
    overlong = dict(kwargs.pop("overlong_buffer_cfg", None) or {})
    mapping = {"enable": "reward.overlong_buffer_enable", "len": "reward.overlong_buffer_len",
               "penalty_factor": "reward.overlong_penalty_factor"}
    for key, native in mapping.items():
        if key in overlong:
            out[native] = overlong.pop(key)
    overlong.pop("log", None)
    if "max_resp_len" in kwargs:
        out["reward.max_response_length"] = int(kwargs.pop("max_resp_len"))
    rest = [f"overlong_buffer_cfg.{k}" for k in overlong] + sorted(kwargs)
    if rest:
        raise ConfigError(f"verl key '{block}.reward_kwargs.{rest[0]}': polyrl's reward managers take no such "
                          "argument; give your custom_reward_function its options itself")
    return out


def _override_config(native: str) -> Converter:
    def convert(value: Any, view: VerlView) -> dict[str, Any]:
        cfg = dict(value or {})
        cfg.pop("moe_config", None)
        inner = cfg.pop("model_config", None) or {}  # verl's megatron tree nests the HF overrides here
        cfg.update(inner)
        return {native: cfg} if cfg else {}

    return convert


def _val_files(value: Any, view: VerlView) -> dict[str, Any]:
    return {"data.val_files": _as_list(value)}


def _lora_targets(native: str) -> Converter:
    return lambda v, view: {native: _as_list(v) if not isinstance(v, str) or v != "all-linear" else ["all-linear"]}


# ---------------------------------------------------------------------------- the table

_PERF = "a speed / memory setting of verl's implementation; polyrl's engines do not have it (results are the same)"
_PROFILE = "profiler settings: polyrl profiles with `polyrl profile` (docs/running.md)"
_RM = ("a setting of verl's reward-model workers that polyrl's reward_model role does not have "
       "(docs/reward_models.md)")


def _unless_none(native: str, fn: Callable[[Any], Any] = lambda v: v) -> Converter:
    """``native`` set from the value, unless verl's value is null (polyrl keeps its default)."""
    return lambda v, view: {} if v is None else {native: fn(v)}


def _role_entries(prefix: str, section: str, *, ref: bool = False, critic: bool = False) -> list[Entry]:
    """Keys every training role shares: engine blocks, optimizer, profiler... (verl keeps the critic's FSDP block
    under ``critic.model.fsdp_config``)."""
    fsdp = f"{prefix}.model.fsdp_config" if critic else f"{prefix}.fsdp_config"
    out: list[Entry] = [
        Ignored(f"{prefix}.profiler.*", _PROFILE, open=True),
        Ignored(f"{prefix}.rollout_n", "a copy of actor_rollout_ref.rollout.n"),
        Ignored(f"{prefix}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is polyrl's "
                f"`{section}.fsdp.ulysses_sequence_parallel_size` (docs/engines/fsdp.md); the verl front end does not "
                "map it yet: set that key in polyrl's layout"),
        Ignored(f"{prefix}.load_weight", "polyrl always loads the weights from the model path"),
        Ignored(f"{fsdp}.*", _PERF),
        Ignored(f"{fsdp}._target_", "verl's dataclass name"),
        Mapped(f"{fsdp}.param_offload", f"{section}.fsdp.param_offload",
               _plugin(prefix, section, "fsdp", "param_offload")),
        Mapped(f"{fsdp}.reshard_after_forward", f"{section}.fsdp.reshard_after_forward",
               _plugin(prefix, section, "fsdp", "reshard_after_forward")),
        Mapped(f"{fsdp}.fsdp_size", f"{section}.fsdp.fsdp_size", _plugin(prefix, section, "fsdp", "fsdp_size")),
        Mapped(f"{fsdp}.dtype", f"{section}.fsdp.param_dtype",
               _plugin(prefix, section, "fsdp", "param_dtype", lambda v: _dtype(v, f"{fsdp}.dtype")),
               note="the compute dtype of FSDP's mixed precision (verl: bfloat16)"),
        Mapped(f"{fsdp}.mixed_precision.param_dtype", f"{section}.fsdp.param_dtype",
               _plugin(prefix, section, "fsdp", "param_dtype", lambda v: _dtype(v, "mixed_precision.param_dtype"))),
        Mapped(f"{fsdp}.mixed_precision.reduce_dtype", f"{section}.fsdp.reduce_dtype",
               _plugin(prefix, section, "fsdp", "reduce_dtype", lambda v: _dtype(v, "mixed_precision.reduce_dtype"))),
        Ignored(f"{fsdp}.mixed_precision.buffer_dtype", "buffers stay in the model's dtype"),
        Ignored(f"{prefix}.megatron.*", "megatron-core tuning polyrl's megatron engine does not expose (offloading, "
                "dist checkpoints, fusions); results are the same"),
        Ignored(f"{prefix}.megatron._target_", "verl's dataclass name"),
        Ignored(f"{prefix}.megatron.override_transformer_config.*", "megatron-core TransformerConfig tuning "
                "(recompute, fusions, MoE dispatch); polyrl's megatron engine builds its own", open=True),
        Ignored(f"{prefix}.megatron.override_ddp_config.*", "megatron-core DDP tuning", open=True),
        Ignored(f"{prefix}.megatron.override_mcore_model_config.*", "megatron-core model tuning", open=True),
        Mapped(f"{prefix}.megatron.tensor_model_parallel_size", f"{section}.megatron.tensor_model_parallel_size",
               _plugin(prefix, section, "megatron", "tensor_model_parallel_size")),
        Mapped(f"{prefix}.megatron.pipeline_model_parallel_size", f"{section}.megatron.pipeline_model_parallel_size",
               _plugin(prefix, section, "megatron", "pipeline_model_parallel_size")),
        Mapped(f"{prefix}.megatron.sequence_parallel", f"{section}.megatron.sequence_parallel",
               _sequence_parallel(prefix, section), note="on only with tensor parallelism, as verl does"),
        Mapped(f"{prefix}.megatron.dtype", f"{section}.megatron.param_dtype",
               _plugin(prefix, section, "megatron", "param_dtype", lambda v: _dtype(v, f"{prefix}.megatron.dtype"))),
        *[Mapped(f"{prefix}.megatron.{key}", f"{section}.megatron.{key}", _plugin(prefix, section, "megatron", key))
          for key in ("context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")],
        *[Mapped(f"{prefix}.megatron.override_transformer_config.{key}", f"{section}.megatron.{key}",
                 _plugin(prefix, section, "megatron", key))
          # a ref only infers: nothing to recompute (its keys fall under override_transformer_config.*)
          for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
          if not ref],
        *[Mapped(f"{prefix}.megatron.override_transformer_config.{key}", f"{section}.megatron.{key}",
                 _plugin(prefix, section, "megatron", key),
                 note="a megatron-core field verl users add with `+`; not in verl's default tree (polyrl only "
                      "lists it so that it is not ignored)")
          for key in ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_z_loss_coeff",
                      "moe_token_dispatcher_type")],
    ]
    if critic:
        out += [Ignored(f"{prefix}.nccl_timeout", "polyrl's process groups use torch's default timeout"),
                Ignored(f"{prefix}.checkpoint.*", "polyrl checkpoints hold model, optimizer and trainer state every "
                        "time; `polyrl export` writes an HF folder")]
    else:
        out += [
            Ignored(f"{prefix}.use_torch_compile", _PERF),
            Ignored(f"{prefix}.entropy_from_logits_with_chunking", _PERF),
            Ignored(f"{prefix}.entropy_checkpointing", _PERF),
            Ignored(f"{prefix}.router_replay.*", "MoE router replay; no effect unless mode is set, refused then"),
            Refused(f"{prefix}.router_replay.mode", "drop it: polyrl does not replay MoE routing", allowed=("disabled",)),
        ]
    if not ref:
        out.append(Ignored(f"{prefix}.data_loader_seed", "polyrl shuffles mini-batches with the role's seed"))
    if not ref and not critic:
        out.append(Ignored(f"{prefix}.checkpoint.*", "polyrl checkpoints hold model, optimizer and trainer state "
                           "every time; `polyrl export` writes an HF folder"))
    if not ref:
        out += [
            Mapped(f"{prefix}.megatron.use_distributed_optimizer", f"{section}.megatron.use_distributed_optimizer",
                   _plugin(prefix, section, "megatron", "use_distributed_optimizer")),
            Mapped(f"{fsdp}.optimizer_offload", f"{section}.fsdp.optimizer_offload",
                   _plugin(prefix, section, "fsdp", "optimizer_offload")),
            Mapped(f"{prefix}.strategy", f"{section}.engine", lambda v, view: {f"{section}.engine": _engine(v, f"{prefix}.strategy")},
                   note="fsdp and fsdp2 -> fsdp; megatron -> megatron"),
            Mapped(f"{fsdp}.seed", f"{section}.seed",
                   lambda v, view: {f"{section}.seed": int(v)} if view.engine(prefix) == "fsdp" else {}),
            Mapped(f"{prefix}.megatron.seed", f"{section}.seed",
                   lambda v, view: {f"{section}.seed": int(v)} if view.engine(prefix) == "megatron" else {}),
            Mapped(f"{fsdp}.model_dtype", f"{section}.model.dtype",
                   lambda v, view: {f"{section}.model.dtype": _dtype(v, f"{fsdp}.model_dtype")}
                   if view.engine(prefix) == "fsdp" else {}, note="storage dtype of the trained weights"),
            # the optimizer
            Ignored(f"{prefix}.optim.*", "megatron optimizer-scheduler details polyrl's schedule does not have"),
            Ignored(f"{prefix}.optim._target_", "verl's dataclass name"),
            Refused(f"{prefix}.optim.optimizer", "polyrl trains with AdamW", allowed=("AdamW", "adam"),
                    allowed_text="`AdamW`, `adam` (megatron's name for AdamW)"),
            Ignored(f"{prefix}.optim.optimizer_impl", "polyrl uses torch.optim.AdamW"),
            Mapped(f"{prefix}.optim.lr", f"{section}.optim.lr"),
            Mapped(f"{prefix}.optim.weight_decay", f"{section}.optim.weight_decay"),
            Mapped(f"{prefix}.optim.betas", f"{section}.optim.betas", _to(f"{section}.optim.betas", _as_list)),
            Mapped(f"{prefix}.optim.lr_warmup_steps", f"{section}.optim.lr_warmup_steps",
                   _to(f"{section}.optim.lr_warmup_steps", lambda v: -1 if v is None else int(v))),
            Mapped(f"{prefix}.optim.lr_warmup_steps_ratio", f"{section}.optim.lr_warmup_steps_ratio"),
            Mapped(f"{prefix}.optim.min_lr_ratio", f"{section}.optim.min_lr_ratio",
                   _to(f"{section}.optim.min_lr_ratio", _none_to(0.0))),
            Mapped(f"{prefix}.optim.num_cycles", f"{section}.optim.num_cycles", placeholder=True,
                   note="verl's 0.5 is cosine's own default: kept out unless you set it"),
            Mapped(f"{prefix}.optim.lr_scheduler_type", f"{section}.optim.lr_scheduler_type"),
            Mapped(f"{prefix}.optim.warmup_style", f"{section}.optim.warmup_style"),
            Mapped(f"{prefix}.optim.lr_decay_style", f"{section}.optim.lr_scheduler_type",
                   note="megatron's name for the schedule (constant, linear, cosine...)"),
            Mapped(f"{prefix}.optim.min_lr", f"{section}.optim.min_lr_ratio", _min_lr(prefix, section),
                   note="as a fraction of optim.lr"),
            Mapped(f"{prefix}.optim.clip_grad", f"{section}.optim.grad_clip", _grad_clip(prefix, section)),
            Mapped(f"{prefix}.grad_clip", f"{section}.optim.grad_clip", _skip,
                   note=f"verl's older spelling of {prefix}.optim.clip_grad; the one you set wins"),
            Ignored(f"{prefix}.optim.total_training_steps", "polyrl fills it from the run's steps"),
            Ignored(f"{prefix}.optim.override_optimizer_config.*", "megatron optimizer tuning (CPU offload, "
                    "precision-aware optimizer)", open=True),
            Refused(f"{prefix}.optim.lr_warmup_init", "polyrl's warmup starts at 0", allowed=(0, 0.0)),
            Refused(f"{prefix}.optim.weight_decay_incr_style", "polyrl keeps weight decay constant",
                    allowed=("constant",)),
            Mapped(f"{prefix}.ppo_mini_batch_size", f"{section}.ppo_mini_batch_size", note="prompts, as in verl"),
            Mapped(f"{prefix}.ppo_epochs", f"{section}.ppo_epochs"),
            Mapped(f"{prefix}.use_dynamic_bsz", f"{section}.use_dynamic_bsz"),
            Mapped(f"{prefix}.ppo_max_token_len_per_gpu", f"{section}.max_token_len_per_gpu"),
            Mapped(f"{prefix}.ppo_micro_batch_size_per_gpu", f"{section}.micro_batch_size",
                   _required_micro(prefix, f"{section}.micro_batch_size", "use_dynamic_bsz")),
            Mapped(f"{prefix}.ppo_micro_batch_size", f"{section}.micro_batch_size", _skip,
                   note="divided by trainer.nnodes * trainer.n_gpus_per_node (verl's deprecated global count)"),
            Mapped(f"{prefix}.loss_agg_mode", f"{section}.loss_agg_mode"),
        ]
    return out


def _model_entries(prefix: str, section: str, *, critic: bool = False) -> list[Entry]:
    """A role's ``model`` block (verl's ``actor_rollout_ref.model``, ``critic.model``)."""
    return [
        Ignored(f"{prefix}._target_", "verl's dataclass name"),
        Mapped(f"{prefix}.path", f"{section}.path", placeholder=True,
               note="verl's default is a path on verl's machines: polyrl needs it set" if not critic else
               "unset: the critic starts from the actor's model"),
        Mapped(f"{prefix}.tokenizer_path", f"{section}.tokenizer_path", placeholder=critic),
        Mapped(f"{prefix}.trust_remote_code", f"{section}.trust_remote_code", placeholder=critic),
        Mapped(f"{prefix}.override_config", f"{section}.override_config", _override_config(f"{section}.override_config"),
               note="megatron's model_config entries too"),
        Mapped(f"{prefix}.override_config.*", f"{section}.override_config", _skip,
               note=f"read with {prefix}.override_config", open=True),
        Mapped(f"{prefix}.enable_gradient_checkpointing", f"{section}.gradient_checkpointing"),
        Mapped(f"{prefix}.lora_rank", f"{section}.lora.rank"),
        Mapped(f"{prefix}.lora_alpha", f"{section}.lora.alpha"),
        Mapped(f"{prefix}.target_modules", f"{section}.lora.target_modules", _lora_targets(f"{section}.lora.target_modules")),
        Ignored(f"{prefix}.lora.*", "megatron LoRA details polyrl's LoRA (peft) does not have"),
        # verl's newer lora block beside lora_rank / lora_alpha (its defaults differ: the one you set wins)
        Mapped(f"{prefix}.lora.rank", f"{section}.lora.rank", placeholder=True),
        Mapped(f"{prefix}.lora.alpha", f"{section}.lora.alpha", placeholder=True),
        Mapped(f"{prefix}.lora.dropout", f"{section}.lora.dropout", placeholder=True),
        Refused(f"{prefix}.lora.type", "polyrl's LoRA is peft's plain LoRA", allowed=("lora",)),
        Refused(f"{prefix}.lora.adapter_path", "polyrl starts LoRA from fresh adapters", allowed=(None,)),
        Ignored(f"{prefix}.use_shm", _PERF),
        Ignored(f"{prefix}.enable_activation_offload", "polyrl's engine option `fsdp.activation_offload` of each role "
                "(docs/engines/fsdp.md); "
                "the verl front end does not map it yet: set that key in polyrl's layout"),
        Ignored(f"{prefix}.tiled_mlp.*", _PERF),
        Refused(f"{prefix}.external_lib", "import your model code in a plugin module listed in the manifest "
                "(docs/plugins)", allowed=(None,)),
    ]


def _build_table() -> list[Entry]:
    t: list[Entry] = []
    # --- actor_rollout_ref
    t += [
        Refused("actor_rollout_ref.hybrid_engine", "polyrl colocates actor and rollout by trainer.placement "
                "(colocated is the default)", allowed=(True,)),
        Ignored("actor_rollout_ref.nccl_timeout", "polyrl's process groups use torch's default timeout"),
    ]
    t += _model_entries(MODEL, "model")
    t += [
        Refused(f"{MODEL}.hf_config_path", "put the config in the model folder", allowed=(None,)),
        Refused(f"{MODEL}.custom_chat_template", "set the template in the tokenizer folder (tokenizer_config.json)",
                allowed=(None,)),
        Mapped(f"{MODEL}.use_remove_padding", "actor.use_remove_padding",
               lambda v, view: {} if view.has(f"{ACTOR}.use_remove_padding") else {"actor.use_remove_padding": v},
               note=f"through {ACTOR}.use_remove_padding, which verl sets from it (megatron's tree: directly)"),
        Refused(f"{MODEL}.exclude_modules", "LoRA: list the modules to adapt in target_modules", allowed=(None,)),
        Refused(f"{MODEL}.lora_adapter_path", "polyrl starts LoRA from fresh adapters", allowed=(None,)),
        Ignored(f"{MODEL}.use_liger", _PERF),
        Ignored(f"{MODEL}.use_fused_kernels", _PERF),
        Ignored(f"{MODEL}.fused_kernel_options.*", _PERF),
        Ignored(f"{MODEL}.mtp.*", "multi-token prediction; no effect unless mtp.enable, refused then"),
        Refused(f"{MODEL}.mtp.enable", "polyrl does not train or serve multi-token prediction heads", allowed=(False,)),
        Refused(f"{MODEL}.lora.merge", "polyrl's rollout gets merged weights or the adapter by "
                "model.lora.sync", allowed=(False,)),
    ]
    t += _role_entries(ACTOR, "actor")
    t += [
        Ignored(f"{ACTOR}._target_", "verl's dataclass name"),
        Mapped(f"{ACTOR}.clip_ratio", "actor.clip_ratio"),
        Mapped(f"{ACTOR}.clip_ratio_low", "actor.clip_ratio_low"),
        Mapped(f"{ACTOR}.clip_ratio_high", "actor.clip_ratio_high"),
        Mapped(f"{ACTOR}.clip_ratio_c", "actor.clip_ratio_c"),
        Mapped(f"{ACTOR}.tau_pos", "actor.policy_loss.extra.tau_pos", note="SAPO"),
        Mapped(f"{ACTOR}.tau_neg", "actor.policy_loss.extra.tau_neg", note="SAPO"),
        Mapped(f"{ACTOR}.freeze_vision_tower", "model.freeze_vision_tower", note="vision-language models"),
        Ignored(f"{ACTOR}.policy_loss._target_", "verl's dataclass name"),
        Mapped(f"{ACTOR}.policy_loss.*", "actor.policy_loss.*", _policy_loss,
               note="same names (loss_mode, clip_cov_*, kl_cov_ratio, ppo_kl_coef...); other names (SAPO's tau_pos, "
               "tau_neg...) go to actor.policy_loss.extra", open=True),
        Mapped(f"{ACTOR}.loss_scale_factor", "actor.loss_scale_factor"),
        Mapped(f"{ACTOR}.entropy_coeff", "actor.entropy_coeff", _to("actor.entropy_coeff", float)),
        Ignored(f"{ACTOR}.calculate_entropy", "polyrl logs the entropy of every old-log-prob pass"),
        Mapped(f"{ACTOR}.use_kl_loss", "actor.use_kl_loss"),
        Mapped(f"{ACTOR}.kl_loss_coef", "actor.kl_loss_coef"),
        Mapped(f"{ACTOR}.kl_loss_type", "actor.kl_loss_type"),
        Mapped(f"{ACTOR}.shuffle", "actor.shuffle"),
        Ignored(f"{ACTOR}.use_prefix_grouper", "polyrl's FSDP engine shares each prompt's forward pass among its "
                "samples by itself (actor.fsdp.shared_prompt)"),
        Ignored(f"{ACTOR}.use_fused_kernels", _PERF),
        Mapped(f"{ACTOR}.use_remove_padding", "actor.use_remove_padding"),
        Refused(f"{ACTOR}.calculate_sum_pi_squared", "the engines do not compute sum_pi_squared yet; choose another "
                "estimator (docs/algorithms.md)", allowed=(False,)),
        Ignored(f"{ACTOR}.sum_pi_squared_checkpointing", _PERF),
    ]
    t += _role_entries(REF, "ref", ref=True)
    t += [
        Ignored(f"{REF}._target_", "verl's dataclass name"),
        Mapped(f"{REF}.strategy", "ref.engine",
               lambda v, view: {"ref.engine": _engine(v, f"{REF}.strategy")}
               if _engine(v, f"{REF}.strategy") != view.engine(ACTOR) else {},
               note="set only when it differs from the actor's"),
        Mapped(f"{REF}.log_prob_micro_batch_size_per_gpu", "ref.micro_batch_size", _ref_micro),
        Mapped(f"{REF}.log_prob_micro_batch_size", "ref.micro_batch_size", _skip,
               note="divided by trainer.nnodes * trainer.n_gpus_per_node"),
        Ignored(f"{REF}.log_prob_use_dynamic_bsz", "the reference batches like the actor (actor.use_dynamic_bsz)"),
        Ignored(f"{REF}.log_prob_max_token_len_per_gpu", "the reference batches like the actor "
                "(actor.max_token_len_per_gpu)"),
        Ignored(f"{REF}.fsdp_config.optimizer_offload", "the reference has no optimizer"),
        Ignored(f"{REF}.fsdp_config.seed", "the reference is the actor's starting weights"),
        Ignored(f"{REF}.fsdp_config.model_dtype", "the reference stores weights like the actor"),
        Ignored(f"{REF}.megatron.use_distributed_optimizer", "the reference has no optimizer"),
        Ignored(f"{REF}.megatron.seed", "the reference is the actor's starting weights"),
    ]
    # rollout
    t += [
        Ignored(f"{ROLLOUT}._target_", "verl's dataclass name"),
        Mapped(f"{ROLLOUT}.name", "rollout.name", note="vllm, sglang, hf"),
        Ignored(f"{ROLLOUT}.mode", "polyrl picks sync or async generation per rollout (rollout.vllm.async_server)"),
        Mapped(f"{ROLLOUT}.temperature", "rollout.temperature", _temperature, note="0 when do_sample=False"),
        Mapped(f"{ROLLOUT}.do_sample", "rollout.temperature", _skip, note="False: greedy (temperature 0)"),
        Mapped(f"{ROLLOUT}.top_k", "rollout.top_k", _to("rollout.top_k", lambda v: -1 if v in (None, 0) else int(v))),
        Mapped(f"{ROLLOUT}.top_p", "rollout.top_p", _to("rollout.top_p", float)),
        Mapped(f"{ROLLOUT}.n", "rollout.n"),
        Ignored(f"{ROLLOUT}.prompt_length", "polyrl takes it from data.max_prompt_length (verl's default too)"),
        Ignored(f"{ROLLOUT}.response_length", "polyrl takes it from data.max_response_length (verl's default too)"),
        Mapped(f"{ROLLOUT}.dtype", "rollout.dtype", _to("rollout.dtype", lambda v: _dtype(v, f"{ROLLOUT}.dtype"))),
        Mapped(f"{ROLLOUT}.gpu_memory_utilization", "rollout.gpu_memory_utilization",
               note="no effect on CPU (vLLM's CPU backend sizes its cache by rollout.vllm.cpu_kvcache_space_gib)"),
        Refused(f"{ROLLOUT}.ignore_eos", "polyrl stops at the end-of-sequence token", allowed=(False,)),
        Mapped(f"{ROLLOUT}.enforce_eager", "rollout.vllm.enforce_eager / rollout.sglang.disable_cuda_graph",
               _rollout_opt("enforce_eager", "disable_cuda_graph")),
        Ignored(f"{ROLLOUT}.cudagraph_capture_sizes", _PERF),
        Mapped(f"{ROLLOUT}.free_cache_engine", "rollout.free_cache_engine"),
        Mapped(f"{ROLLOUT}.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
        Ignored(f"{ROLLOUT}.data_parallel_size", f"polyrl runs one rollout replica per {ROLLOUT}."
                "tensor_model_parallel_size devices: verl's data parallelism inside a server becomes more replicas "
                "(the same samples; expert parallelism, which would shard the experts over them, is refused)"),
        Ignored(f"{ROLLOUT}.expert_parallel_size", f"polyrl's rollouts shard an MoE model's experts by {ROLLOUT}."
                "tensor_model_parallel_size only (the same samples; a model that needed verl's wider expert sharding "
                "may not fit its replicas' memory: raise tensor_model_parallel_size)"),
        Refused(f"{ROLLOUT}.pipeline_model_parallel_size", "polyrl's rollouts shard by tensor parallelism only",
                allowed=(1,)),
        Mapped(f"{ROLLOUT}.max_num_batched_tokens", "rollout.vllm.max_num_batched_tokens",
               _rollout_opt("max_num_batched_tokens", None), note="vLLM only"),
        Mapped(f"{ROLLOUT}.max_model_len", "rollout.max_model_len", _to("rollout.max_model_len", _none_to(0))),
        Mapped(f"{ROLLOUT}.max_num_seqs", "rollout.vllm.max_num_seqs / rollout.sglang.max_running_requests / "
               "rollout.max_batch_size (hf)", _rollout_opt("max_num_seqs", "max_running_requests", hf="max_batch_size")),
        Ignored(f"{ROLLOUT}.enable_chunked_prefill", "on in vLLM and SGLang by default"),
        Mapped(f"{ROLLOUT}.enable_prefix_caching", "rollout.vllm.enable_prefix_caching / rollout.sglang.disable_radix_cache",
               lambda v, view: _rollout_opt("enable_prefix_caching", None)(v, view) or
               _rollout_opt(None, "disable_radix_cache", lambda x: not x)(v, view)),
        Ignored(f"{ROLLOUT}.logprobs_mode", "polyrl's rollouts return the log-probs of the sampling distribution "
                "(after temperature), verl's processed_logprobs"),
        Ignored(f"{ROLLOUT}.scheduling_policy", _PERF),
        Mapped(f"{ROLLOUT}.load_format", "rollout.vllm.load_format", _rollout_opt("load_format", None),
               note="vLLM only (dummy: weights arrive with the first sync)"),
        Ignored(f"{ROLLOUT}.log_prob_micro_batch_size", "polyrl's old-log-prob pass batches like the actor's update "
                "(actor.micro_batch_size); the split does not change the numbers"),
        Ignored(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", "polyrl's old-log-prob pass batches like the actor's "
                "update (actor.micro_batch_size); the split does not change the numbers"),
        Ignored(f"{ROLLOUT}.log_prob_use_dynamic_bsz", "the old-log-prob pass follows actor.use_dynamic_bsz"),
        Ignored(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", "the old-log-prob pass follows "
                "actor.max_token_len_per_gpu"),
        Ignored(f"{ROLLOUT}.disable_log_stats", "polyrl's rollouts log no engine statistics"),
        Refused(f"{ROLLOUT}.over_sample_rate", "polyrl waits for every sample of a step", allowed=(0, 0.0)),
        Ignored(f"{ROLLOUT}.multi_stage_wake_up", _PERF),
        Mapped(f"{ROLLOUT}.engine_kwargs.vllm", "rollout.vllm.engine_kwargs", _engine_kwargs("vllm")),
        Mapped(f"{ROLLOUT}.engine_kwargs.vllm.*", "rollout.vllm.engine_kwargs", _skip,
               note=f"read with {ROLLOUT}.engine_kwargs.vllm", open=True),
        Mapped(f"{ROLLOUT}.engine_kwargs.sglang", "rollout.sglang.engine_kwargs", _engine_kwargs("sglang"),
               note="attention_backend goes to rollout.sglang.attention_backend"),
        Mapped(f"{ROLLOUT}.engine_kwargs.sglang.*", "rollout.sglang.engine_kwargs", _skip,
               note=f"read with {ROLLOUT}.engine_kwargs.sglang", open=True),
        Ignored(f"{ROLLOUT}.engine_kwargs.trtllm.*", "polyrl has no TensorRT-LLM rollout", open=True),
        Ignored(f"{ROLLOUT}.val_kwargs._target_", "verl's dataclass name"),
        Mapped(f"{ROLLOUT}.val_kwargs.temperature", "rollout.val_temperature", _val_temperature,
               note="0 when val_kwargs.do_sample=False (verl's default: greedy)"),
        Mapped(f"{ROLLOUT}.val_kwargs.do_sample", "rollout.val_temperature", _skip),
        Mapped(f"{ROLLOUT}.val_kwargs.top_p", "rollout.val_top_p", _to("rollout.val_top_p", float)),
        Mapped(f"{ROLLOUT}.val_kwargs.n", "rollout.val_n"),
        Refused(f"{ROLLOUT}.val_kwargs.top_k", "validation samples without top-k", allowed=(-1, 0)),
        Ignored(f"{ROLLOUT}.multi_turn._target_", "verl's dataclass name"),
        Mapped(f"{ROLLOUT}.multi_turn.enable", "agent.default_loop", _skip,
               note=f"True: tool_agent (read with {ROLLOUT}.agent.default_agent_loop)"),
        Mapped(f"{ROLLOUT}.multi_turn.max_assistant_turns", "agent.max_turns",
               lambda v, view: {"agent.max_turns": int(v)} if v is not None else {}),
        Refused(f"{ROLLOUT}.multi_turn.tool_config_path", "list the tools in agent.tools (registered names or "
                "module:function; docs/agents.md)", allowed=(None,)),
        Refused(f"{ROLLOUT}.multi_turn.max_user_turns", "polyrl's tool agent ends a trajectory after "
                "agent.max_turns assistant turns", allowed=(None,)),
        Mapped(f"{ROLLOUT}.multi_turn.max_parallel_calls", "agent.max_parallel_calls"),
        Mapped(f"{ROLLOUT}.multi_turn.max_tool_response_length", "agent.max_tool_response_length"),
        Refused(f"{ROLLOUT}.multi_turn.tool_response_truncate_side", "polyrl cuts the middle of a long tool response",
                allowed=("middle",)),
        Refused(f"{ROLLOUT}.multi_turn.interaction_config_path", "polyrl has no simulated-user interactions yet",
                allowed=(None,)),
        Ignored(f"{ROLLOUT}.multi_turn.use_inference_chat_template", "polyrl renders every turn with the "
                "tokenizer's chat template"),
        Ignored(f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode", "polyrl tokenizes each turn once"),
        Mapped(f"{ROLLOUT}.multi_turn.format", "agent.tool_parser"),
        Ignored(f"{ROLLOUT}.multi_turn.num_repeat_rollouts", "a tool-agent trajectory runs once per sample"),
        Ignored(f"{ROLLOUT}.calculate_log_probs", "polyrl's rollouts always return per-token log-probs"),
        Ignored(f"{ROLLOUT}.agent._target_", "verl's dataclass name"),
        Ignored(f"{ROLLOUT}.agent.num_workers", "agent loops run as coroutines on each rollout worker"),
        Mapped(f"{ROLLOUT}.agent.default_agent_loop", "agent.default_loop", _agent_loop,
               note="single_turn_agent -> single_turn, tool_agent -> tool_agent"),
        Refused(f"{ROLLOUT}.agent.agent_loop_config_path", "register agent loops through a plugin "
                "(register_agent_loops; docs/agent_loops.md)", allowed=(None,)),
        Ignored(f"{ROLLOUT}.agent.custom_async_server.*", "no effect unless its path is set, refused then"),
        Refused(f"{ROLLOUT}.agent.custom_async_server.path", "register a rollout through a plugin "
                "(register_rollouts)", allowed=(None,)),
        Ignored(f"{ROLLOUT}.checkpoint_engine.*", "polyrl syncs weights by trainer.weight_transfer"),
        Mapped(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", "trainer.weight_bucket_mb"),
        Ignored(f"{ROLLOUT}.trace.*", "rollout tracing (weave / mlflow traces): the run keeps its generations "
                "instead (trainer.rollout_data_dir, trainer.validation_data_dir)"),
        Refused(f"{ROLLOUT}.skip_rollout", "polyrl generates every step", allowed=(False,)),
        Ignored(f"{ROLLOUT}.skip_dump_dir", "used only with skip_rollout, which is refused"),
        Ignored(f"{ROLLOUT}.skip_tokenizer_init", _PERF),
        Refused(f"{ROLLOUT}.enable_rollout_routing_replay", "polyrl does not replay MoE routing", allowed=(False,)),
        Ignored(f"{ROLLOUT}.profiler.*", _PROFILE, open=True),
        Ignored(f"{ROLLOUT}.prometheus.*", "vLLM's Prometheus endpoint; polyrl's rollouts keep to loopback"),
        Refused(f"{ROLLOUT}.quantization", "polyrl's rollouts serve the trained weights unquantized", allowed=(None,)),
        Refused(f"{ROLLOUT}.quantization_config_file", "polyrl's rollouts serve the trained weights unquantized",
                allowed=(None,)),
        Ignored(f"{ROLLOUT}.mtp.*", f"a copy of {MODEL}.mtp"),
        Ignored(f"{ROLLOUT}.mtp", f"a copy of {MODEL}.mtp"),
        Ignored(f"{ROLLOUT}.layered_summon", _PERF),
        Ignored(f"{ROLLOUT}.layer_name_map.*", "weight names are mapped by the engines"),
    ]
    # critic
    t += _model_entries("critic.model", "critic.model", critic=True)
    t += _role_entries("critic", "critic", critic=True)
    t += [
        Ignored("critic._target_", "verl's dataclass name"),
        Refused("critic.enable", "polyrl starts a critic exactly when algorithm.adv_estimator needs values (gae)",
                check=lambda v: v is None, allowed_text="null"),
        Mapped("critic.model.use_remove_padding", "critic.use_remove_padding"),
        Mapped("critic.cliprange_value", "critic.cliprange_value"),
        Ignored("critic.shuffle", "the critic's mini-batches follow the batch order"),
        Ignored("critic.forward_micro_batch_size", "the value pass batches like the critic's update"),
        Ignored("critic.forward_micro_batch_size_per_gpu", "the value pass batches like the critic's update"),
        Ignored("critic.forward_max_token_len_per_gpu", "the value pass batches like the critic's update"),
    ]
    # verl's current critic keeps its FSDP block at critic.fsdp (the older critic.model.fsdp_config still works)
    t += [
        Ignored("critic.fsdp.*", _PERF),
        Ignored("critic.fsdp._target_", "verl's dataclass name"),
        *[Mapped(f"critic.fsdp.{key}", f"critic.fsdp.{key}", _plugin("critic", "critic", "fsdp", key))
          for key in ("param_offload", "optimizer_offload", "reshard_after_forward", "fsdp_size")],
        Mapped("critic.fsdp.dtype", "critic.fsdp.param_dtype",
               _plugin("critic", "critic", "fsdp", "param_dtype", lambda v: _dtype(v, "critic.fsdp.dtype"))),
        Mapped("critic.fsdp.seed", "critic.seed",
               lambda v, view: {"critic.seed": int(v)} if view.engine("critic") == "fsdp" else {}),
        Mapped("critic.fsdp.model_dtype", "critic.model.dtype",
               lambda v, view: {"critic.model.dtype": _dtype(v, "critic.fsdp.model_dtype")}
               if view.engine("critic") == "fsdp" else {}, note="storage dtype of the critic's weights"),
        Refused("critic.fsdp.qat.enable", "polyrl trains without quantization-aware training", allowed=(False,)),
        Ignored("critic.loss_scale_factor", f"follows {ACTOR}.loss_scale_factor"),
        Refused("critic.model.hf_config_path", "put the config in the model folder", allowed=(None,)),
        Refused("critic.model.custom_chat_template", "set the template in the tokenizer folder", allowed=(None,)),
        Refused("critic.model.exclude_modules", "LoRA: list the modules to adapt in target_modules", allowed=(None,)),
        Refused("critic.model.lora_adapter_path", "polyrl starts LoRA from fresh adapters", allowed=(None,)),
        Ignored("critic.model.use_liger", _PERF),
        Ignored("critic.model.use_fused_kernels", _PERF),
        Ignored("critic.model.fused_kernel_options.*", _PERF),
        Ignored("critic.model.mtp.*", "multi-token prediction; no effect unless mtp.enable, refused then"),
        Refused("critic.model.mtp.enable", "polyrl does not train multi-token prediction heads", allowed=(False,)),
    ]
    # data
    t += [
        Refused("data.tokenizer", f"set {MODEL}.tokenizer_path", allowed=(None,)),
        Ignored("data.use_shm", _PERF),
        Mapped("data.train_files", "data.train_files", _to("data.train_files", _as_list), placeholder=True,
               note="a single path becomes a list"),
        Mapped("data.val_files", "data.val_files", _val_files, placeholder=True, note="a single path becomes a list"),
        Refused("data.train_max_samples", "cut the training file instead", check=lambda v: v is None or int(v) < 0,
                allowed_text="-1 or null"),
        Mapped("data.val_max_samples", "data.val_max_samples", _to("data.val_max_samples", _never_if_negative)),
        Mapped("data.prompt_key", "data.prompt_key"),
        Mapped("data.reward_fn_key", "data.reward_fn_key"),
        Mapped("data.max_prompt_length", "data.max_prompt_length"),
        Mapped("data.max_response_length", "data.max_response_length"),
        Mapped("data.train_batch_size", "data.train_batch_size", note="prompts per step"),
        Mapped("data.val_batch_size", "data.val_batch_size", _to("data.val_batch_size", _none_to(0))),
        Ignored("data.tool_config_path", f"a copy of {ROLLOUT}.multi_turn.tool_config_path"),
        Ignored("data.return_raw_input_ids", "the rollout works on the chat-templated prompt ids"),
        Ignored("data.return_raw_chat", "agent loops get the raw chat of every row"),
        Ignored("data.return_full_prompt", "the generation dumps hold the prompt text"),
        Mapped("data.shuffle", "data.shuffle"),
        Mapped("data.seed", "data.seed", _to("data.seed", _none_to(1)), note="null: 1, as verl"),
        Ignored("data.dataloader_num_workers", "rows are read once at start-up"),
        Ignored("data.image_patch_size", "multimodal rows are not supported by the verl front end yet"),
        Refused("data.validation_shuffle", "validation runs in file order", allowed=(False,)),
        Mapped("data.filter_overlong_prompts", "data.truncation", _skip, note="True: truncation=filter"),
        Ignored("data.filter_overlong_prompts_workers", "rows are filtered in the driver"),
        Mapped("data.truncation", "data.truncation", _truncation, note="error, left, right; filter with "
               "filter_overlong_prompts"),
        Mapped("data.image_key", "data.image_key", note="vision-language models (docs/vlm.md)"),
        Ignored("data.video_key", "multimodal rows are not supported by the verl front end yet"),
        Ignored("data.trust_remote_code", f"the tokenizer follows {MODEL}.trust_remote_code"),
        Ignored("data.custom_cls.*", "no effect unless its path is set, refused then"),
        Refused("data.custom_cls.path", "register a dataset loader through a plugin (register_datasets)", allowed=(None,)),
        Ignored("data.return_multi_modal_inputs", "multimodal rows are not supported by the verl front end yet"),
        Ignored("data.sampler.*", "no effect unless its class_path is set, refused then"),
        Refused("data.sampler.class_path", "polyrl samples prompts uniformly (data.shuffle)", allowed=(None,)),
        Ignored("data.datagen.*", "no effect unless its path is set, refused then"),
        Refused("data.datagen.path", "polyrl reads prompts from data.train_files", allowed=(None,)),
        Mapped("data.apply_chat_template_kwargs", "data.apply_chat_template_kwargs",
               _to("data.apply_chat_template_kwargs", lambda v: dict(v or {}))),
        Mapped("data.apply_chat_template_kwargs.*", "data.apply_chat_template_kwargs", _skip,
               note="read with data.apply_chat_template_kwargs", open=True),
    ]
    # reward
    t += [
        Ignored("reward_manager._target_", "verl's dataclass name"),
        Refused("reward_manager.source", "register reward managers through a plugin (register_reward_managers)",
                allowed=("register",)),
        Mapped("reward_manager.name", "reward.manager", _reward_manager, placeholder=True,
               note="naive, batch, dapo (verl's default follows reward_model.reward_manager)"),
        Ignored("reward_manager.module.*", "used only with reward_manager.source=importlib, which is refused"),
        Mapped("reward_model.reward_manager", "reward.manager", _unless_none("reward.manager", str),
               note="naive, batch, dapo, or one a plugin registers (verl's older spelling of "
               "reward.reward_manager.name; the one you set wins)"),
        Mapped("reward_model.enable", "reward_model.enable", note="a discriminative reward model (docs/reward_models.md)"),
        Ignored("reward_model.*", _RM),
        Mapped("reward_model.strategy", "reward_model.engine",
               lambda v, view: {"reward_model.engine": _engine(v, "reward_model.strategy")}),
        Mapped("reward_model.model.path", "reward_model.model.path", placeholder=True),
        Mapped("reward_model.model.trust_remote_code", "reward_model.model.trust_remote_code"),
        Mapped("reward_model.model.override_config", "reward_model.model.override_config",
               _unless_none("reward_model.model.override_config", lambda v: dict(v or {}))),
        Ignored("reward_model.model.input_tokenizer", "polyrl compares the policy's and the reward model's tokenizers "
                "itself and re-templates when they differ (reward_model.input_format=auto)"),
        Mapped("reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size",
               _micro("reward_model", "reward_model.micro_batch_size", "micro_batch_size",
                      "micro_batch_size_per_gpu", "use_dynamic_bsz")),
        Mapped("reward_model.micro_batch_size", "reward_model.micro_batch_size", _skip,
               note="through reward_model.micro_batch_size_per_gpu (divided by the world size)"),
        Mapped("reward_model.max_length", "reward_model.max_length", _unless_none("reward_model.max_length")),
        Mapped("reward_model.use_dynamic_bsz", "reward_model.use_dynamic_bsz",
               _unless_none("reward_model.use_dynamic_bsz", bool)),
        Mapped("reward_model.forward_max_token_len_per_gpu", "reward_model.max_token_len_per_gpu",
               _unless_none("reward_model.max_token_len_per_gpu", int)),
        Refused("reward_model.enable_resource_pool", "give the reward model a pool of its own with "
                "trainer.placement={actor: main, rollout: main, reward_model: rm} and trainer.pools={rm: N} "
                "(docs/placement.md)", allowed=(False,)),
        Mapped("reward_model.num_workers", "reward.num_workers", placeholder=True,
               note="threads that run reward calls"),
        Refused("reward_model.reward_loop_source", "register reward managers through a plugin", allowed=("register",)),
        Refused("reward_model.reward_loop_module_path", "register reward managers through a plugin", allowed=(None,)),
        Mapped("reward_model.sandbox_fusion.url", "reward.sandbox_fusion.url", _unless_none("reward.sandbox_fusion.url"),
               note="code rewards run on that SandboxFusion server (docs/reward_models.md)"),
        Mapped("reward_model.sandbox_fusion.memory_limit_mb", "reward.sandbox_fusion.memory_limit_mb",
               _unless_none("reward.sandbox_fusion.memory_limit_mb", int)),
        Mapped("reward_model.sandbox_fusion.max_concurrent", "reward.sandbox_fusion.max_concurrent",
               _unless_none("reward.sandbox_fusion.max_concurrent", int),
               note="requests in flight to the server; reward.num_workers caps them too"),
        Mapped("reward_model.reward_kwargs.*", "reward.overlong_buffer_enable / reward.overlong_buffer_len / "
               "reward.overlong_penalty_factor / reward.max_response_length",
               _reward_kwargs, note="DAPO's overlong_buffer_cfg (enable, len, penalty_factor) and max_resp_len",
               open=True),
        Mapped("custom_reward_function.path", "reward.custom_reward_function.path"),
        Mapped("custom_reward_function.name", "reward.custom_reward_function.name",
               lambda v, view: {"reward.custom_reward_function.name": v} if view.get("custom_reward_function.path")
               else {}),
    ]
    # algorithm
    t += [
        Ignored("algorithm._target_", "verl's dataclass name"),
        Mapped("algorithm.gamma", "algorithm.gamma"),
        Mapped("algorithm.lam", "algorithm.lam"),
        Mapped("algorithm.adv_estimator", "algorithm.adv_estimator"),
        Mapped("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
        Mapped("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
        Mapped("algorithm.kl_penalty", "algorithm.kl_penalty"),
        Ignored("algorithm.kl_ctrl._target_", "verl's dataclass name"),
        Mapped("algorithm.kl_ctrl.*", "algorithm.kl_ctrl.*",
               lambda v, view: {f"algorithm.kl_ctrl.{k}": x for k, x in (v or {}).items() if k != "_target_"},
               open=True),
        Refused("algorithm.use_pf_ppo", "PF-PPO is a recipe (polyrl-recipes' pf_ppo)", allowed=(False,)),
        Ignored("algorithm.pf_ppo.*", "used only with use_pf_ppo, which is refused"),
        Mapped("algorithm.rollout_correction.*", "algorithm.rollout_correction.*",
               lambda v, view: {f"algorithm.rollout_correction.{k}": x for k, x in (v or {}).items()
                                if k != "_target_"}, open=True),
        Mapped("algorithm.filter_groups.*", "algorithm.filter_groups.*", _filter_groups,
               note="DAPO's dynamic sampling: enable, metric, max_num_gen_batches (verl's 0, unlimited, is kept out "
               "unless you set it)", open=True),
        Ignored("algorithm.filter_groups._target_", "verl's dataclass name"),
        Ignored("algorithm.filter_groups.max_inflight_gen_batches", "polyrl generates one batch of prompts at a time"),
    ]
    # trainer
    t += [
        Mapped("trainer.balance_batch", "trainer.balance_batch"),
        Mapped("trainer.total_epochs", "trainer.total_epochs"),
        Mapped("trainer.total_training_steps", "trainer.total_steps", _to("trainer.total_steps", _never_if_negative)),
        Mapped("trainer.project_name", "trainer.project_name"),
        Mapped("trainer.experiment_name", "trainer.experiment_name"),
        Mapped("trainer.logger", "trainer.logger", _loggers, note="verl's file -> jsonl; jsonl is always kept"),
        Mapped("trainer.log_val_generations", "trainer.log_val_generations", placeholder=True,
               note="verl's 0 keeps polyrl's default"),
        Mapped("trainer.rollout_data_dir", "trainer.rollout_data_dir", _to("trainer.rollout_data_dir", _none_to(""))),
        Mapped("trainer.validation_data_dir", "trainer.validation_data_dir",
               _to("trainer.validation_data_dir", lambda v: "" if v is None else str(v)), placeholder=True,
               note="verl's default (null) keeps polyrl's (on); null set by you: off"),
        Mapped("trainer.nnodes", "trainer.n_workers", _layout, note="n_workers = nnodes * n_gpus_per_node"),
        Mapped("trainer.n_gpus_per_node", "trainer.n_workers", _skip, note="with trainer.nnodes"),
        Mapped("trainer.save_freq", "trainer.save_freq", _to("trainer.save_freq", _never_if_negative),
               note="-1 (never) -> 0"),
        Ignored("trainer.esi_redundant_time", "polyrl checkpoints by save_freq; a killed run resumes from the last"),
        Mapped("trainer.resume_mode", "trainer.resume", _resume),
        Mapped("trainer.resume_from_path", "trainer.resume", _skip, note="with resume_mode=resume_path"),
        Mapped("trainer.val_before_train", "trainer.val_before_train"),
        Refused("trainer.val_only", "polyrl has no validation-only run yet: trainer.val_before_train=True with "
                "trainer.total_training_steps=1 validates first (and trains one step)", allowed=(False,)),
        Mapped("trainer.test_freq", "trainer.test_freq", _to("trainer.test_freq", _never_if_negative),
               note="-1 (never) -> 0"),
        Mapped("trainer.critic_warmup", "critic.warmup_steps"),
        Refused("trainer.default_hdfs_dir", "copy the run directory yourself", allowed=(None,)),
        Ignored("trainer.del_local_ckpt_after_load", "polyrl keeps trainer.max_checkpoints checkpoints"),
        Mapped("trainer.default_local_dir", "trainer.run_dir", note="the whole run goes there, checkpoints included"),
        Mapped("trainer.max_actor_ckpt_to_keep", "trainer.max_checkpoints",
               _to("trainer.max_checkpoints", _never_if_negative), note="null: keep all"),
        Ignored("trainer.max_critic_ckpt_to_keep", "actor and critic share each checkpoint (max_actor_ckpt_to_keep)"),
        Ignored("trainer.ray_wait_register_center_timeout", "polyrl's workers start without a register center"),
        Mapped("trainer.device", "trainer.device", placeholder=True,
               note="verl's cuda keeps polyrl's auto (the accelerator if there is one)"),
        Ignored("trainer.use_legacy_worker_impl", "polyrl has one worker implementation"),
        Ignored("global_profiler.*", _PROFILE, open=True),
        Refused("transfer_queue.enable", "polyrl moves batches through its worker groups", allowed=(False,)),
        Mapped("ray_kwargs.ray_init.num_cpus", "trainer.ray_num_cpus", _to("trainer.ray_num_cpus", _none_to(0))),
        Ignored("ray_kwargs.timeline_json_file", _PROFILE),
    ]
    # verl's current trees (2026-08): model_engine, the reward block, distillation, the v1 trainer, skip, QAT
    t += [
        Refused("model_engine", "polyrl's engines are fsdp (verl's dp) and megatron; the actor's strategy follows the "
                "tree model_engine chooses", allowed=("dp", "megatron")),
        Ignored("ray_kwargs.ray_init.runtime_env.*", "the Ray cluster polyrl starts gives its workers the "
                "environment of `polyrl train`: export the variables before the run (on a cluster you started, "
                "+trainer.ray_address, set them where its nodes start)", open=True),
        Ignored("ray_kwargs.ray_init.runtime_env.py_executable", "polyrl's workers run the interpreter of `polyrl "
                "train` (its virtual environment)"),
        Ignored("ray_kwargs.ray_init.*", "Ray start-up options polyrl does not pass (trainer.ray_num_cpus, "
                "trainer.ray_address)", open=True),
        Ignored("reward._target_", "verl's dataclass name"),
        Mapped("reward.reward_kwargs.*", "reward.overlong_buffer_enable / reward.overlong_buffer_len / "
               "reward.overlong_penalty_factor / reward.max_response_length",
               lambda v, view: _reward_kwargs(v, view, "reward"),
               note="as reward_model.reward_kwargs (DAPO's overlong_buffer_cfg, max_resp_len)", open=True),
        Mapped("reward.num_workers", "reward.num_workers", placeholder=True, note="threads that run reward calls"),
        Mapped("reward.custom_reward_function.path", "reward.custom_reward_function.path",
               _unless_none("reward.custom_reward_function.path"),
               note="verl's current spelling of custom_reward_function.path"),
        Mapped("reward.custom_reward_function.name", "reward.custom_reward_function.name",
               lambda v, view: {"reward.custom_reward_function.name": v}
               if view.get("reward.custom_reward_function.path") else {}),
        Ignored("reward.reward_manager._target_", "verl's dataclass name"),
        Refused("reward.reward_manager.source", "register reward managers through a plugin (register_reward_managers)",
                allowed=("register",)),
        Mapped("reward.reward_manager.name", "reward.manager", _reward_manager, placeholder=True,
               note="naive, batch, dapo, or one a plugin registers"),
        Ignored("reward.reward_manager.module.*", "used only with reward_manager.source=importlib, which is refused"),
        Mapped("reward.reward_model.enable", "reward_model.enable",
               note="a discriminative reward model (docs/reward_models.md)"),
        Mapped("reward.reward_model.model_path", "reward_model.model.path", _unless_none("reward_model.model.path")),
        Ignored("reward.reward_model.*", _RM),
        Refused("reward.reward_model.enable_resource_pool", "give the reward model a pool of its own with "
                "trainer.placement and trainer.pools (docs/placement.md)", allowed=(False,)),
        Ignored("reward.reward_model.rollout.*", "verl serves its reward model with a rollout engine; polyrl's "
                "reward_model role scores with the model itself (docs/reward_models.md)", open=True),
        Ignored("reward.sandbox_fusion._target_", "verl's dataclass name"),
        *[Mapped(f"{block}.{key}", f"reward.sandbox_fusion.{key}", _unless_none(f"reward.sandbox_fusion.{key}", fn),
                 note="as reward_model.sandbox_fusion" if key == "url" else "")
          for block in ("reward.sandbox_fusion", "sandbox_fusion")
          for key, fn in (("url", lambda v: v), ("memory_limit_mb", int), ("max_concurrent", int))],
        Ignored("distillation.*", "on-policy distillation; no effect unless distillation.enabled, refused then",
                open=True),
        Refused("distillation.enabled", "polyrl has no on-policy distillation trainer (a teacher's log-probs as the "
                "loss); train with a reward, or write the loss as a policy-loss plugin", allowed=(False,)),
        Ignored("skip.*", "verl's rollout dump and replay for debugging; no effect unless enabled, refused then"),
        *[Refused(f"skip.{part}.enable", "polyrl generates every step; `polyrl view` shows what a run generated",
                  allowed=(False,)) for part in ("rollout", "async_rollout", "rollout_tq")],
        Ignored("trainer.use_v1", "verl's choice of trainer implementation; polyrl has one"),
        Ignored("trainer.v1.*", "options of verl's v1 trainer modes; no effect unless trainer_mode is changed, "
                "refused then", open=True),
        Refused("trainer.v1.trainer_mode", "polyrl's asynchronous training is +trainer.async_mode (docs/async.md)",
                allowed=("sync",)),
        Refused("trainer.v1.sampler.custom_sampler.path", "polyrl samples prompts uniformly (data.shuffle)",
                allowed=(None,)),
        Ignored("transfer_queue.*", "polyrl moves batches through its worker groups; no effect unless enable, refused "
                "then"),
        Ignored(f"{ACTOR}.qat.*", "quantization-aware training; no effect unless enable, refused then"),
        Refused(f"{ACTOR}.qat.enable", "polyrl trains without quantization-aware training", allowed=(False,)),
        Ignored(f"{ACTOR}.fsdp_config.qat.*", "quantization-aware training; no effect unless enable, refused then"),
        Refused(f"{ACTOR}.fsdp_config.qat.enable", "polyrl trains without quantization-aware training",
                allowed=(False,)),
        *[Ignored(f"{prefix}.fsdp_config.turbo_config.*", _PERF, open=True) for prefix in (ACTOR, REF)],
        *[Ignored(f"{prefix}.{key}", _PERF) for prefix in (ACTOR, REF)
          for key in ("entropy_from_logits_chunk_size", "pad_to_length")],
        Ignored(f"{ROLLOUT}.disaggregation.*", "prefill/decode disaggregation; no effect unless enabled, refused then"),
        Refused(f"{ROLLOUT}.disaggregation.enabled", "polyrl's rollouts prefill and decode on the same engine",
                allowed=(False,)),
        Ignored(f"{ROLLOUT}.full_determinism", _PERF),
        Ignored(f"{ROLLOUT}.moe_tensor_parallel_size", "an SGLang MoE sharding option (verl users add with `+`); "
                f"polyrl's rollouts shard by {ROLLOUT}.tensor_model_parallel_size (results are the same)"),
        Ignored(f"{ROLLOUT}.moe_load_balance_metrics_interval", "MoE routing metrics of verl's rollout"),
        Ignored(f"{ROLLOUT}.seed", "the rollout's sampling seed follows trainer.seed"),
        Ignored(f"{ROLLOUT}.qat", f"a copy of {ACTOR}.qat"),
        Ignored(f"{ROLLOUT}.qat.*", f"a copy of {ACTOR}.qat"),
        Ignored(f"{ROLLOUT}.n_gpus_per_node", "a copy of trainer.n_gpus_per_node"),
        Refused(f"{ROLLOUT}.nnodes", "give the rollout its own pool with trainer.placement and trainer.pools "
                "(docs/placement.md)", allowed=(0,)),
        Refused(f"{ROLLOUT}.multi_turn.function_tool_path", "declare tools in the tool config "
                f"({ROLLOUT}.multi_turn.tool_config_path)", allowed=(None,)),
        Ignored("data.function_tool_path", f"a copy of {ROLLOUT}.multi_turn.function_tool_path"),
        Ignored("data.audio_key", "multimodal rows are not supported by the verl front end yet"),
        Ignored("data.mm_processor_kwargs", "multimodal rows are not supported by the verl front end yet"),
        Ignored("data.mm_processor_kwargs.*", "multimodal rows are not supported by the verl front end yet",
                open=True),
        Ignored("data.gen_batch_size", "DAPO's generation batch: polyrl's dynamic sampling generates "
                "data.train_batch_size prompts a round (algorithm.filter_groups.max_num_gen_batches rounds at most)"),
    ]
    # polyrl's own settings a verl-layout config may add (with +, as verl's tree does not have them)
    t += [Mapped(f"trainer.{key}", f"trainer.{key}", note="polyrl only: add it with +") for key in (
        "executor", "progress_bar", "placement", "rollout_workers", "ray_address", "seed", "async_mode")]
    return t


#: The whole table, in the order docs/from_verl.md shows it.
TABLE: list[Entry] = _build_table()
_EXACT: dict[str, Entry] = {}
_PATTERNS: list[Entry] = []
for _e in TABLE:
    if "*" in _e.verl:
        _PATTERNS.append(_e)
    else:
        if _e.verl in _EXACT:
            raise RuntimeError(f"verl key {_e.verl} has two entries in polyrl.config.verl_table")
        _EXACT[_e.verl] = _e


def _pattern_matches(pattern: str, key: str) -> bool:
    if pattern.endswith(".*") and key == pattern[:-2]:
        return True
    return fnmatch.fnmatchcase(key, pattern)


@functools.lru_cache(maxsize=4096)
def classify(key: str) -> Entry | None:
    """The entry for verl key ``key``: the exact one, else the longest matching pattern; None if none."""
    if key in _EXACT:
        return _EXACT[key]
    matches = [e for e in _PATTERNS if _pattern_matches(e.verl, key)]
    if not matches:
        return None
    return max(matches, key=lambda e: len(e.verl.replace("*", "")))


def kind(entry: Entry) -> str:
    """``mapped``, ``ignored`` or ``refused``."""
    return {Mapped: "mapped", Ignored: "ignored", Refused: "refused"}[type(entry)]


# ---------------------------------------------------------------------------- docs

BEGIN, END = "<!-- verl-table:begin (python -m polyrl.config.verl_table --write) -->", "<!-- verl-table:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The three lists as Markdown (the generated part of docs/from_verl.md)."""
    out = ["### Mapped", "", "| verl key | polyrl key | note |", "|---|---|---|"]
    out += [f"| `{e.verl}` | `{e.native}` | {_cell(e.note)}{' (verl default kept out)' if e.placeholder else ''} |"
            for e in TABLE if isinstance(e, Mapped)]
    out += ["", "### Accepted with no effect", "", "| verl key | why |", "|---|---|"]
    out += [f"| `{e.verl}` | {_cell(e.reason)} |" for e in TABLE if isinstance(e, Ignored)]
    out += ["", "### Refused", "", "A refused key stops the run before anything starts (one line, exit 2) when it "
            "holds anything but the values listed.", "", "| verl key | fine values | what to do instead |",
            "|---|---|---|"]
    for e in TABLE:
        if isinstance(e, Refused):
            fine = e.allowed_text or ", ".join("null" if a is None else f"`{a}`" for a in (e.allowed or ()))
            out.append(f"| `{e.verl}` | {fine or 'verl default'} | {_cell(e.instead)} |")
    return "\n".join(out) + "\n"


def write_docs(page: Path) -> None:
    """Replace the generated part of ``page`` (between the markers) with :func:`render`."""
    text = page.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    page.write_text(f"{head}{BEGIN}\n\n{render()}\n{END}{tail}")


def generated_part(page_text: str) -> str:
    """The text between the markers of docs/from_verl.md."""
    return page_text.partition(BEGIN)[2].partition(END)[0].strip("\n") + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_docs(Path(sys.argv[2] if len(sys.argv) > 2 else "docs/from_verl.md"))
    else:
        sys.stdout.write(render())
