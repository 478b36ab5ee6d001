"""What every recipe trainer shares: its block, the estimator and loss it selects, its start-up checks.

A recipe is a :class:`polyrl.trainer.ppo.PPOTrainer` subclass registered with ``register_trainers`` and
selected with ``trainer.name``; it changes the one training loop only through the trainer's documented
extension points (docs/plugins/trainers.md, docs/plugins/forward_products.md): ``before_advantage`` /
``after_advantage``, ``generate_batch(..., sampling=...)``, ``provides_fields``, ``extra_roles`` and a
worker subclass (``worker_cls``) for its own worker methods.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from polyrl.errors import ConfigError
from polyrl.trainer.ppo import PPOTrainer

log = logging.getLogger("polyrl")

#: The core's defaults of the keys a recipe selects: a value still equal to them was not chosen by the user.
_DEFAULT_ESTIMATOR = "grpo"
_DEFAULT_LOSS = "vanilla"


class RecipeTrainer(PPOTrainer):
    """A PPO-loop trainer for one recipe (``trainer.name=<recipe>``, options in ``trainer.<recipe>``).

    Subclasses set :attr:`recipe` and, when the recipe has its own, :attr:`adv_estimator` /
    :attr:`loss_mode`: a run that leaves ``algorithm.adv_estimator`` / ``actor.policy_loss.loss_mode`` at the
    core's defaults gets the recipe's, one that names another is refused in one line (naming the key).
    """

    #: The recipe's name: its ``trainer.name`` and the key of its block.
    recipe: ClassVar[str] = ""
    #: The advantage estimator / policy loss the recipe runs (``None``: the run's own).
    adv_estimator: ClassVar[str | None] = None
    loss_mode: ClassVar[str | None] = None
    #: The schema class of the recipe's block (used when the run gave no block).
    options_cls: ClassVar[type | None] = None

    def __init__(self, config: Any, *, manifest: Any = None, plugins: Any = None) -> None:
        self.options = config.trainer.plugin_config
        if self.options is None and self.options_cls is not None:
            self.options = config.trainer.plugin_config = self.options_cls()
        self.configure(config)
        super().__init__(config, manifest=manifest, plugins=plugins)
        if self.use_critic:  # `polyrl train` checked the engines of the estimator it saw, before the recipe chose its own
            self._check_engine_name("critic", config.critic.engine)

    # ------------------------------------------------------------------ start-up
    def configure(self, config: Any) -> None:
        """Adjust ``config`` for the recipe before the core trainer reads it (no worker exists yet); raise
        :class:`ConfigError` for what the recipe cannot run with. The default selects the recipe's estimator
        and loss."""
        self.select("algorithm.adv_estimator", config.algorithm, "adv_estimator", self.adv_estimator,
                    _DEFAULT_ESTIMATOR)
        self.select("actor.policy_loss.loss_mode", config.actor.policy_loss, "loss_mode", self.loss_mode,
                    _DEFAULT_LOSS)

    def select(self, key: str, block: Any, attr: str, wanted: str | None, default: str) -> None:
        """Set ``block.<attr>`` (config key ``key``) to the recipe's ``wanted`` value unless the user chose
        another one (a value other than the core's ``default``), which is a :class:`ConfigError`."""
        if wanted is None:
            return
        current = getattr(block, attr)
        if current not in (wanted, default):
            raise ConfigError(f"{key}={current}: trainer.name={self.recipe} runs {key}={wanted}; drop the key or set "
                              f"it to {wanted}")
        setattr(block, attr, wanted)

    def require_critic(self, config: Any) -> None:
        """Raise :class:`ConfigError` when the run is told to go without a value model (``critic.enable=false``):
        the recipe needs one."""
        if str(config.critic.enable).lower() == "false":
            raise ConfigError(f"critic.enable=false: trainer.name={self.recipe} trains a critic (a value model); set "
                              "critic.enable=auto")

    def group(self, role: str) -> Any:
        """The worker group serving ``role`` in this run (after ``fit()`` started the groups)."""
        group = self.groups.group_of(role) if self.groups is not None else None
        if group is None:
            raise RuntimeError(f"trainer.name={self.recipe}: no worker group serves role '{role}'")
        return group

    def _check_engine_name(self, section: str, engine: str) -> None:
        try:
            self.pm.entry("engine", engine)
        except LookupError as exc:
            raise ConfigError(f"config key '{section}.engine': {exc}") from None
