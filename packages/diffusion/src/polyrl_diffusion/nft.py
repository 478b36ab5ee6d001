"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) as an algorithm of the ``flow_grpo`` trainer.

Select it with ``trainer.flow_grpo.algorithm: diffusion_nft`` (options in ``trainer.flow_grpo.nft``).
The step is the core's, unchanged: generate -> reward -> advantages (the ``flow_grpo`` estimator:
normalised rewards) -> actor update -> weight sync. What differs is the actor update
(:func:`update_actor_nft`, called by the worker in place of the PPO update):

1. the rollout's clean samples ``x0`` are noised on the forward process at ``K`` times per image (by default
   distinct sigmas of the sampler's schedule, as the reference), ``x_t = (1 - t) x0 + t eps``, with the
   flow-matching target ``v = eps - x0``;
2. the old policy's velocity ``v_old`` at those points is computed once, before any optimiser step
   (every epoch and mini-batch of ``actor.ppo_epochs`` reuses it: it is a field of the training batch);
3. the loss is :func:`polyrl_diffusion.algorithms.compute_diffusion_nft_loss` with the optimality
   probability ``r = 1/2 + 1/2 clip(A / adv_clip_max, -1, 1)`` of each image;
4. the old policy (the engine's ``old`` weight copy: the rollout samples with it) moves towards the trained
   weights, ``old = d old + (1 - d) w`` with the reference's growing ``d``.

Nothing per sampling step is needed (no log-probs, no SDE): any sampler works (the reference's and the default
here are deterministic), and the training forward is CFG-free (conditional velocity only).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

#: the engine's weight copy that holds DiffusionNFT's old policy (samples and gives ``v_old``)
OLD_POLICY = "old"
#: batch fields of the rollout the NFT update keeps (text conditioning); CFG's negative branch is dropped
CONDITIONING = ("prompt_embeds", "pooled_prompt_embeds", "text_ids", "prompt_attention_mask", "embedded_guidance")


@dataclass
class DiffusionNFTConfig:
    """``trainer.flow_grpo.nft``: DiffusionNFT's options (defaults: the authors' SD3 recipe, docs/diffusion.md)."""

    #: ``beta`` of the implicit policies ``v+ = (1 - beta) v_old + beta v``, ``v- = (1 + beta) v_old - beta v``.
    beta: float = 1.0
    #: Where the forward-process times come from: ``schedule`` (the reference: distinct sigmas of the sampler's
    #: ``train_steps`` schedule, ``int(timestep_fraction * train_steps)`` per image in random order) or ``uniform``
    #: (``num_timesteps`` times drawn uniformly in ``[t_min, t_max]``).
    times: str = "schedule"
    timestep_fraction: float = 0.99
    num_timesteps: int = 4
    t_min: float = 0.05
    t_max: float = 0.95
    #: ``r = 1/2 + 1/2 clip(A / adv_clip_max, -1, 1)`` from the normalised reward ``A``; the policy loss is
    #: multiplied by ``adv_clip_max`` (as the authors' code does), so its gradient scales with ``A``.
    adv_clip_max: float = 5.0
    #: The authors' per-sample normalisation of each branch by its mean absolute x0 error (always on there).
    adaptive_weight: bool = True
    #: ``kl_coef * ||v - v_ref||^2`` to the reference (the adapter-disabled model or the ref engine).
    kl_coef: float = 1e-4
    #: Sample with the ODE (the reference samples with a deterministic solver); false: with the noise settings.
    deterministic: bool = True
    #: The old policy, which samples and gives ``v_old``: after each training step ``old = d old + (1 - d) w``
    #: with ``d = min((optimizer steps - old_decay_start) * old_decay_rate, old_decay_max)`` (0 before
    #: ``old_decay_start``): the reference's ``decay_type`` 1 (type 2: 75, 0.0075, 0.999; 0: rate 0, on-policy).
    old_decay_start: int = 0
    old_decay_rate: float = 0.001
    old_decay_max: float = 0.5


def check_nft_config(cfg: DiffusionNFTConfig, key: str = "trainer.flow_grpo.nft") -> None:
    """ConfigErrors naming the key, before any worker starts (the numbers: :func:`polyrl_diffusion.config.check_numbers`)."""
    from polyrl.errors import ConfigError
    from polyrl_diffusion.config import check_numbers

    check_numbers(cfg, key, prefix="nft.")
    if cfg.times not in ("schedule", "uniform"):
        raise ConfigError(f"{key}.times={cfg.times!r}: choose 'schedule' (the sampler's sigmas) or 'uniform'")
    if cfg.t_min > cfg.t_max:
        raise ConfigError(f"{key}.t_min={cfg.t_min} / {key}.t_max={cfg.t_max}: need t_min <= t_max")


def nft_batch(batch: Any, cfg: DiffusionNFTConfig, *, generator: Any = None) -> Any:
    """The forward-process training batch of DiffusionNFT from a rollout batch.

    Needs ``x0`` ``[B, C, H, W]`` and ``advantages`` ``[B, T]`` (one value per image on its trained steps), and
    with ``times: schedule`` the rollout's ``schedule_sigmas`` ``[B, S + 1]``: each image gets
    ``K = max(1, int(timestep_fraction * S))`` distinct sigmas of ``schedule_sigmas[:, :S]`` in random order (the
    reference's ``randperm`` over the sampler's timesteps). ``times: uniform``: ``K = num_timesteps`` times uniform
    in ``[t_min, t_max]``.
    Returns ``latents`` ``[B, K, C, H, W]`` (the noised ``x_t``), ``sigmas`` ``[B, K]`` (``t``),
    ``nft_target`` (``eps - x0``), ``nft_reward_prob`` ``[B]``, ``response_mask`` ``[B, K]`` and the
    text conditioning (without CFG's negative branch: NFT trains CFG-free).
    """
    import torch
    from tensordict import TensorDict

    from polyrl_diffusion.algorithms import optimality_probability

    for name in ("x0", "advantages"):
        if name not in batch.keys():
            raise KeyError(f"DiffusionNFT needs batch field '{name}' (rollout 'diffusers' sets x0; the trainer's "
                           "advantage estimator sets advantages); the batch has " + ", ".join(sorted(batch.keys())))
    x0 = batch["x0"].float()
    b = x0.shape[0]
    adv = batch["advantages"].float()
    mask = batch["response_mask"].float() if "response_mask" in batch.keys() else torch.ones_like(adv)
    per_image = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1) if adv.dim() == 2 else adv.reshape(b)
    if cfg.times == "schedule":
        if "schedule_sigmas" not in batch.keys():
            raise KeyError("DiffusionNFT with nft.times=schedule needs batch field 'schedule_sigmas' (the diffusers "
                           "rollout sets it); the batch has " + ", ".join(sorted(batch.keys())))
        sched = batch["schedule_sigmas"].float()[:, :-1]  # the S sampling times (sigma 0 excluded)
        s = sched.shape[1]
        k = max(1, int(cfg.timestep_fraction * s))
        order = torch.stack([torch.randperm(s, generator=generator)[:k] for _ in range(b)])
        t = torch.gather(sched, 1, order)
    else:
        k = int(cfg.num_timesteps)
        t = cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(b, k, generator=generator)
    eps = torch.randn((b, k, *x0.shape[1:]), generator=generator)
    tt = t.reshape(b, k, *([1] * (x0.dim() - 1)))
    x_t = (1 - tt) * x0.unsqueeze(1) + tt * eps
    fields = {
        "latents": x_t,
        "sigmas": t,
        "nft_target": eps - x0.unsqueeze(1),
        "nft_reward_prob": optimality_probability(per_image, cfg.adv_clip_max),
        "response_mask": torch.ones(b, k, dtype=torch.long),
    }
    for name in CONDITIONING:
        if name in batch.keys():
            fields[name] = batch[name]
    return TensorDict(fields, batch_size=[b])


def make_nft_loss(cfg: DiffusionNFTConfig) -> Any:
    """The engine loss: DiffusionNFT on each (image, time) pair of a micro-batch, summed and divided by the
    mini-batch's global pair count (``scale.batch_num_tokens``), so micro-batch and DP splits add up."""
    import torch

    from polyrl_diffusion.algorithms import compute_diffusion_nft_loss

    def loss(out: Any, mb: Any, scale: Any) -> tuple[torch.Tensor, dict[str, float]]:
        v = out["velocity"]
        b, k = v.shape[:2]
        flat = (b * k, *v.shape[2:])
        r = mb["nft_reward_prob"].reshape(b, 1).expand(b, k).reshape(-1)
        weight = mb["response_mask"].reshape(-1).float()
        v_ref = mb["nft_ref_velocity"].reshape(flat) if "nft_ref_velocity" in mb.keys() else None
        value, metrics = compute_diffusion_nft_loss(
            v.reshape(flat), mb["nft_old_velocity"].reshape(flat), mb["nft_target"].reshape(flat), r,
            beta=cfg.beta, adaptive_weight=cfg.adaptive_weight, t=mb["sigmas"].reshape(-1), v_ref=v_ref,
            kl_coef=cfg.kl_coef, sample_weight=weight, policy_scale=cfg.adv_clip_max)
        total = getattr(scale, "batch_num_tokens", None)
        if total:  # the mean over this micro-batch's pairs -> its share of the mini-batch's mean
            value = value * weight.sum() / total
        metrics["actor/nft_loss"] = float(value.detach())
        return value, metrics

    return loss


def update_actor_nft(worker: Any, batch: Any) -> dict[str, float]:
    """The DiffusionNFT actor update on ``batch`` (this rank's shard), in place of the PPO update.

    ``worker`` is the flow_grpo role worker: ``worker.actor`` (the diffusers engine), ``worker.ref`` (or
    None: the adapter-disabled actor), ``worker.config``. Mini-batches and epochs as the PPO update
    (``actor.ppo_mini_batch_size`` prompts x ``rollout.n``, ``actor.ppo_epochs``:
    :func:`polyrl.trainer.updates.run_update_epochs`). ``v_old`` is the old policy's
    (the engine's ``old`` weight copy, which the rollout sampled with); after the update the old policy moves
    towards the trained weights by ``1 - decay`` (:func:`~polyrl_diffusion.weight_copies.old_policy_decay`).
    """
    import torch

    from polyrl.trainer.updates import mini_batch_rows, run_update_epochs
    from polyrl_diffusion.sampler import group_seed

    cfg = nft_options(worker.config)
    actor_cfg = worker.config.actor
    # the forward-process draws follow trainer.seed, the training step (the rollout's ``train_step`` field;
    # a count of updates for a batch without it) and the rank: reproducible, distinct per step and rank
    calls = int(getattr(worker, "_nft_calls", 0))
    worker._nft_calls = calls + 1
    step = int(batch["train_step"][0]) if "train_step" in batch.keys() and batch.batch_size[0] else f"call{calls}"
    seed = group_seed(int(worker.config.trainer.seed), f"nft:{step}:{worker.actor.dp_rank}")
    data = nft_batch(batch, cfg, generator=torch.Generator().manual_seed(seed))
    actor = worker.actor
    old = actor.weight_copy(OLD_POLICY) if OLD_POLICY in getattr(actor, "weight_copies", {}) else nullcontext()
    with torch.no_grad():
        with old:
            data["nft_old_velocity"] = actor.infer_batch(data)["velocity"].detach()
        if cfg.kl_coef > 0:
            engine = worker.ref if worker.ref is not None else worker.actor
            data["nft_ref_velocity"] = engine.infer_batch(data, disable_adapter=worker.ref is None)["velocity"]
    rows = mini_batch_rows(actor_cfg.ppo_mini_batch_size, worker.config.rollout.n, worker.actor.dp_size)
    metrics = run_update_epochs(worker.actor, data, rows, actor_cfg.ppo_epochs, make_nft_loss(cfg),
                                shuffle=actor_cfg.shuffle, seed=worker.actor.dp_rank)
    if OLD_POLICY in getattr(actor, "weight_copies", {}):
        from polyrl_diffusion.weight_copies import old_policy_decay

        decay = old_policy_decay(int(actor.step), cfg.old_decay_start, cfg.old_decay_rate, cfg.old_decay_max)
        actor.update_weight_copy(OLD_POLICY, 1.0 - decay)
        metrics["nft/old_policy_decay"] = decay
    return metrics


def nft_options(config: Any) -> DiffusionNFTConfig:
    """``trainer.flow_grpo.nft`` of a run's config (the defaults when the block is absent)."""
    plugin = getattr(config.trainer, "plugin_config", None)
    value = getattr(plugin, "nft", None)
    if isinstance(value, DiffusionNFTConfig):
        return value
    if isinstance(value, dict):
        return DiffusionNFTConfig(**value)
    return DiffusionNFTConfig()


def is_nft(config: Any) -> bool:
    """Whether a run's config selects DiffusionNFT (``trainer.flow_grpo.algorithm: diffusion_nft``)."""
    plugin = getattr(config.trainer, "plugin_config", None)
    return str(getattr(plugin, "algorithm", "flow_grpo") or "flow_grpo") == "diffusion_nft"
