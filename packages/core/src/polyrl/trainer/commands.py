"""What the ``polyrl`` verbs ``train``, ``sft``, ``export`` and ``plot`` run.

Each function is usable from Python as well as from the CLI:

```python
from polyrl.trainer.commands import train
train(manifest="polyrl.toml", configs=["my_run.yaml"], overrides=["trainer.total_steps=20"])
```
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.errors import CheckpointError, ConfigError, PolyrlError
from polyrl.manifest import Manifest

log = logging.getLogger("polyrl")


def _plugins(manifest: str | Path | Manifest | None) -> tuple[Manifest | None, Any]:
    from polyrl import plugins

    if isinstance(manifest, (str, Path)):
        manifest = Manifest.load(manifest)
    pm = plugins.activate(manifest)
    return manifest, pm


def _check_names(config: Any, pm: Any, sections: Sequence[str]) -> None:
    """Fail before starting any worker when a role names an engine or rollout no loaded plugin provides."""
    for section in sections:
        role = getattr(config, section)
        kind, name = ("rollout", role.name) if section == "rollout" else ("engine", role.engine)
        try:
            pm.entry(kind, name)
        except LookupError as exc:
            key = f"{section}.name" if section == "rollout" else f"{section}.engine"
            raise ConfigError(f"config key '{key}': {exc}") from None


def _speaks_config_layout(fn: Any) -> Any:
    """In verl's layout, an error names verl's keys (:func:`polyrl.config.verl.reword`, imported when an error
    needs it, so that commands which never read a config stay light)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PolyrlError as exc:
            from polyrl.config.verl import reword

            reword(exc, fn, args, kwargs)
            raise

    return wrapper


@_speaks_config_layout
def train(manifest: str | Path | Manifest | None = None, configs: Sequence[str | Path] = (),
          overrides: Sequence[str] = (), *, base: dict | None = None, config_format: str = "auto",
          config_path: str | Path | None = None, config_name: str | None = None,
          dry_run: bool = False) -> dict[str, float]:
    """``polyrl train``: RL post-training (PPO / GRPO and family). Returns the final metrics.

    ``config_format`` / ``config_path`` / ``config_name``: the config's layout (``auto``, ``native``, ``verl``;
    see :func:`polyrl.config.loader.load_config`). ``dry_run``: run every start-up check (plugins and their
    versions, model paths, data files and columns, reward reachability, layouts, placement) and return ``{}``
    before any worker starts.
    """
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig

    manifest, pm = _plugins(manifest)
    config = load_config(PolyrlConfig, configs, overrides, base=base, plugins=pm, config_format=config_format,
                         config_path=config_path, config_name=config_name)
    try:
        estimator = pm.entry("advantage_estimator", config.algorithm.adv_estimator)
    except LookupError as exc:
        raise ConfigError(f"config key 'algorithm.adv_estimator': {exc}") from None
    needs_critic = (config.algorithm.adv_estimator == "gae" or estimator.metadata.get("needs_values")
                    or str(config.critic.enable).lower() == "true")
    sections = ["actor", "rollout"] + (["critic"] if needs_critic else [])
    _check_names(config, pm, sections)
    if not dry_run:  # (a dry run checks everything, finished or not)
        from polyrl.trainer.summary import finished_run

        done = finished_run(config)  # started again after its last step: say so, start nothing (no torch, no Ray)
        if done is not None:
            return done
    trainer = _trainer_factory(config, pm)(config, manifest=manifest, plugins=pm)
    if dry_run:
        trainer.check_placement()
        log.info("polyrl train --dry-run: every start-up check passed (config, plugins, model, data, rewards, "
                 "layout, placement); no worker was started")
        return {}

    def attempt(number: int) -> Any:
        """The first attempt's trainer, or (after a lost worker) a new one from the same config that resumes."""
        if number == 0:
            return trainer
        again = load_config(PolyrlConfig, configs, [*overrides, "trainer.resume=auto"], base=base, plugins=pm,
                            config_format=config_format, config_path=config_path, config_name=config_name)
        return _trainer_factory(again, pm)(again, manifest=manifest, plugins=pm)

    from polyrl.trainer.restarts import fit_with_restarts

    return fit_with_restarts(attempt)  # trainer.max_restarts: resumes by itself after a lost worker or node


def _trainer_factory(config: Any, pm: Any) -> Any:
    """The trainer class ``trainer.name`` names (``ppo``: the core's); a ConfigError naming the key otherwise."""
    from polyrl.trainer.ppo import PPOTrainer

    trainer_name = config.trainer.name
    if trainer_name in pm.registry("trainer"):
        return pm.get("trainer", trainer_name)
    if trainer_name == "ppo":
        return PPOTrainer
    known = sorted({"ppo", *pm.registry("trainer").names()})
    raise ConfigError(f"config key 'trainer.name': no loaded plugin registers trainer {trainer_name!r} "
                      f"(registered: {', '.join(known)}). Install the plugin that provides it and list it in the "
                      "manifest, or use trainer.name=ppo")


def sft(manifest: str | Path | Manifest | None = None, configs: Sequence[str | Path] = (),
        overrides: Sequence[str] = (), *, base: dict | None = None) -> dict[str, float]:
    """``polyrl sft``: supervised warm start; writes ``RUN_DIR/hf``."""
    from polyrl.config.loader import load_config
    from polyrl.config.schema import SFTConfig
    from polyrl.trainer.sft import SFTTrainer

    manifest, pm = _plugins(manifest)
    config = load_config(SFTConfig, configs, overrides, base=base, plugins=pm)
    _check_names(config, pm, ["actor"])
    return SFTTrainer(config, manifest=manifest).fit()


def export(checkpoint: str | Path, to: str | Path, manifest: str | Path | Manifest | None = None,
           overrides: Sequence[str] = (), *, trust_remote_code: bool = False, allow_run_modules: bool = False) -> Path:
    """``polyrl export CKPT --to DIR [key=value ...]``: write a checkpoint's actor as an HF folder.

    The folder is what ``save_pretrained`` writes (config, generation config, safetensors sharded with an index
    above the engine's shard size, tokenizer). ``overrides`` change the run's config for the export, e.g. the
    fsdp engine's ``actor.fsdp.lora_export=adapter`` (a peft adapter folder instead of merged weights) or
    ``actor.fsdp.export_max_shard_size=2GB``. The actor is built by the run's trainer's worker class
    (``trainer.name``'s ``worker_cls``, e.g. polyrl-diffusion's image worker), so a plugin trainer's checkpoint
    exports in its own format (a diffusion run writes a diffusers pipeline folder).

    The export runs in this process, without Ray or worker processes, when the checkpoint fits one process: the
    actor's engine runs on one rank (no tensor or pipeline parallelism) and can read the weights of a checkpoint
    written by any number of ranks (its ``load_checkpoint`` takes ``model_only``; the fsdp engine's does).
    Otherwise it starts the run's worker group. ``trainer.executor=...`` (or ``trainer.n_workers=...``) among
    ``overrides`` decides instead.

    A run directory may come from someone else, so exporting it runs nothing from it unless asked
    (docs/security.md): the checkpoint's files are verified and loaded as data only; a run config that sets
    ``actor.model.trust_remote_code`` is refused unless ``trust_remote_code`` (``--trust-remote-code``); a
    ``manifest.lock.toml`` that names ``modules`` to import is refused unless ``allow_run_modules``
    (``--allow-run-modules``) or another ``manifest`` is given; the run's ``trainer.ray_address`` is ignored
    (the export runs here) unless an override sets it.
    """
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.trainer.checkpoint import verify_checkpoint
    from polyrl.trainer.executor import resolve_executor
    from polyrl.trainer.role_groups import open_role_group

    ckpt = Path(checkpoint).resolve()
    if not (ckpt / "actor").exists():
        raise CheckpointError(f"{ckpt} is not a polyrl checkpoint (no 'actor' folder); expected RUN_DIR/checkpoints/step_N")
    run_dir = ckpt.parent.parent
    config_file = run_dir / "config.yaml"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} is missing: export needs the run's config next to its checkpoints")
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as exc:
        raise CheckpointError(f"polyrl export: the checkpoint is damaged: {exc}; export another checkpoint of the "
                              "run") from None
    if manifest is None and (run_dir / "manifest.lock.toml").exists():
        manifest = Manifest.load(run_dir / "manifest.lock.toml")
        if manifest.modules and not allow_run_modules:
            raise ConfigError(
                f"{run_dir / 'manifest.lock.toml'} names modules to import ({', '.join(manifest.modules)}): exporting "
                "would run their code. Pass --allow-run-modules if you trust this run directory, or --manifest with "
                "a manifest of your own")
    manifest, pm = _plugins(manifest)
    config = load_config(PolyrlConfig, [config_file], overrides, plugins=pm)
    if config.actor.model.trust_remote_code and not trust_remote_code and not _overridden(
            overrides, "actor.model.trust_remote_code"):
        raise ConfigError(
            f"{config_file} sets actor.model.trust_remote_code=true: exporting would run Python files shipped with "
            f"the model ({config.actor.model.path}). Pass --trust-remote-code if you trust this run directory and "
            "that model")
    if not _overridden(overrides, "trainer.ray_address"):
        config.trainer.ray_address = ""  # never join a cluster a downloaded config names: the export runs here
    config.trainer.run_dir = str(run_dir)
    worker_cls = getattr(_trainer_factory(config, pm), "worker_cls", None)
    chosen = _overridden(overrides, "trainer.executor") or _overridden(overrides, "trainer.n_workers")
    if not chosen and _fits_one_process(config, pm):
        config.trainer.executor = "local"
    resolve_executor(config)  # otherwise the executor the run trained with (config.yaml holds the resolved one)
    started = open_role_group(config, roles=["actor"], manifest=manifest, name="export", run_dir=run_dir,
                              role_kind="sft", worker_cls=worker_cls)
    try:
        started.group.call_all("load_checkpoint", str(ckpt), model_only=True)
        started.group.call_all("export_hf", str(Path(to).resolve()))
    finally:
        started.shutdown()
    return Path(to)


def _fits_one_process(config: Any, pm: Any) -> bool:
    """Whether the actor's engine can export from one process: its layout fits one rank and its
    ``load_checkpoint`` reads the weights of a checkpoint of any world size (``model_only``)."""
    import inspect

    try:
        factory = pm.get("engine", config.actor.engine)
    except LookupError:
        return False
    size_of = getattr(factory, "data_parallel_size", None)
    if size_of is not None:
        try:
            size_of(config.actor, 1)
        except Exception:  # a tensor / pipeline parallel layout that needs more ranks
            return False
    load = getattr(factory, "load_checkpoint", None)
    if load is None:
        return False
    try:
        return "model_only" in inspect.signature(load).parameters
    except (TypeError, ValueError):
        return False


def _overridden(overrides: Sequence[str], key: str) -> bool:
    """Whether a command-line ``key=value`` sets ``key``."""
    return any(o.split("=", 1)[0].strip() == key for o in overrides)


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """``polyrl plot RUN_DIR``: PNG curves; returns the file written."""
    from polyrl.plotting import plot_run

    return plot_run(run_dir, out)
