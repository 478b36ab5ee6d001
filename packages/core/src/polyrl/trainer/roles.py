"""The roles a run's workers serve, and how a role beyond the built-in four is declared.

Built in: ``actor`` (trained policy), ``rollout`` (generation), ``ref`` (reference policy) and ``critic``
(value model), which :class:`polyrl.trainer.role_worker.Worker` knows by name. Any other role is described by
a :class:`RoleSpec`: where its config block is, what the worker builds for it (an engine, or a rollout on
its own model), and which worker methods serve it. The core declares ``reward_model``
(:func:`reward_model_spec`); a plugin trainer declares its own (``teacher`` for distillation) by returning
specs from :meth:`polyrl.trainer.ppo.PPOTrainer.extra_roles`. The one role-group helper
(:func:`polyrl.trainer.role_groups.build_role_groups`) starts every role, and ``trainer.placement`` puts
each in a pool (:mod:`polyrl.trainer.placement`). See docs/plugins/roles.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polyrl.protocols import INFERENCE_ROLES as _INFERENCE_ROLES

#: The roles every worker knows by name.
BUILTIN_ROLES: tuple[str, ...] = ("actor", "rollout", "ref", "critic")

#: Roles whose engines only infer (defined in :mod:`polyrl.protocols`, which engines import).
INFERENCE_ROLES = _INFERENCE_ROLES

#: What a :class:`RoleSpec` may build.
ROLE_BUILDS: tuple[str, ...] = ("engine", "rollout")


@dataclass(frozen=True)
class RoleSpec:
    """A worker role beyond actor / rollout / ref / critic.

    ``builds="engine"``: each worker holding the role builds ``engine_factory(block, role=name,
    model_type=model_type, platform=...)`` from the registry entry the block's ``engine`` names (the block is an
    :class:`~polyrl.config.roles.EngineRoleConfig`-like object: ``engine``, ``model``, ``micro_batch_size``,
    ``plugin_config``...). ``builds="rollout"``: it builds the rollout the block's ``rollout.name`` names on the
    block's own ``model.path`` (a generative reward model's judge), never synced from the actor.

    ``methods`` are the worker methods that serve the role: their batches are split by the role engine's
    data-parallel layout (``Worker.dp_layout``), or by rank for a rollout role. Built-in methods for
    ``reward_model`` live on :class:`~polyrl.trainer.role_worker.Worker`; a plugin adds its own methods in its
    worker subclass (``PPOTrainer.worker_cls``) and names them here.
    """

    #: The role's name, as ``trainer.placement`` and the worker's ``roles`` spell it.
    name: str
    #: Dotted path of the role's config block in the run config (``reward_model``, ``trainer.plugin_config.teacher``).
    section: str
    #: ``engine`` or ``rollout`` (see above).
    builds: str = "engine"
    #: The engine's ``model_type`` (``causal_lm`` for log-probs, ``value`` for a scalar head).
    model_type: str = "causal_lm"
    #: Worker methods that serve this role.
    methods: tuple[str, ...] = ()
    #: Whether the role's engine trains: it then gets an optimizer (its name must not be one of
    #: :data:`INFERENCE_ROLES`), and checkpoints save and restore it under ``<checkpoint>/<name>``. The
    #: update itself is a method of the plugin's worker subclass.
    trains: bool = False
    #: Free the role's device memory after each call when it shares its workers with other roles
    #: (``Engine.offload``, ``Rollout.sleep``) and take it back before the next.
    offload_when_shared: bool = True
    #: Anything else the role's worker code needs (a plugin's own settings).
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name in BUILTIN_ROLES:
            raise ValueError(f"role '{self.name}' is built in; a RoleSpec declares a role beyond {BUILTIN_ROLES}")
        if self.builds not in ROLE_BUILDS:
            raise ValueError(f"role '{self.name}': builds={self.builds!r}; choose one of {ROLE_BUILDS}")
        if self.trains and (self.builds != "engine" or self.name in INFERENCE_ROLES):
            raise ValueError(f"role '{self.name}': a trained role builds an engine and is not named like an "
                             f"inference-only role ({', '.join(sorted(INFERENCE_ROLES))})")

    def block(self, config: Any) -> Any:
        """The role's config block in ``config`` (``section`` followed attribute by attribute)."""
        obj = config
        for part in self.section.split("."):
            obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
            if obj is None:
                raise KeyError(f"role '{self.name}': the run config has no block '{self.section}'")
        return obj


def role_specs_by_name(specs: Any) -> dict[str, RoleSpec]:
    """``{name: spec}`` of ``specs``; a name given twice is an error."""
    out: dict[str, RoleSpec] = {}
    for spec in specs or ():
        if spec.name in out:
            raise ValueError(f"role '{spec.name}' is declared twice")
        out[spec.name] = spec
    return out
