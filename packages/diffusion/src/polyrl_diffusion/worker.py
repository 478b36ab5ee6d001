"""The flow_grpo worker: the core role worker with image batches and the diffusion model type."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from polyrl.trainer.role_worker import Worker

#: Text fields whose rows may differ in length (QwenImage's prompts; right-padded, the masks with 0).
PADDED_TEXT_FIELDS = ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask")


def collate_images(outputs: list[Any]) -> TensorDict:
    """A batch from diffusion trajectories: every tensor / number extra stacked as a ``[B, ...]`` field,
    strings as non-tensor fields (field list: docs/diffusion.md, "Batch fields"). Text fields of different
    lengths (:data:`PADDED_TEXT_FIELDS`: QwenImage rows generated in different calls) are right-padded with zeros
    to the longest."""
    from polyrl.batch import set_non_tensor

    b = len(outputs)
    batch = TensorDict({}, batch_size=[b])
    keys = sorted({k for o in outputs for k in o.extra})
    for key in keys:
        values = [o.extra.get(key) for o in outputs]
        first = values[0]
        if key in PADDED_TEXT_FIELDS and all(isinstance(v, torch.Tensor) for v in values):
            longest = max(v.shape[0] for v in values)
            if any(v.shape[0] != longest for v in values):
                values = [torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, longest - v.shape[0]))
                          for v in values]
                first = values[0]
        if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) and v.shape == first.shape for v in values):
            rows = _consecutive_rows(values)
            batch[key] = rows if rows is not None else torch.stack(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            batch[key] = torch.tensor([float(v) for v in values])
        else:
            set_non_tensor(batch, key, values)
    return batch


def _consecutive_rows(values: list[torch.Tensor]) -> torch.Tensor | None:
    """``values`` as one ``[B, ...]`` view when they are the consecutive rows of one contiguous tensor (what the
    ``diffusers`` rollout hands out: rows of its per-chunk trajectory), so collating copies nothing; else None."""
    first = values[0]
    if not first.is_contiguous() or first.numel() == 0:
        return None
    step, ptr, offset = first.numel(), first.untyped_storage().data_ptr(), first.storage_offset()
    for i, v in enumerate(values):
        if (v.untyped_storage().data_ptr() != ptr or v.storage_offset() != offset + i * step or v.dtype != first.dtype
                or not v.is_contiguous()):
            return None
    return first.as_strided((len(values), *first.shape), (step, *first.stride()), offset)


def flow_options(config: Any) -> Any:
    """The run's ``trainer.flow_grpo`` block as a :class:`~polyrl_diffusion.config.FlowGRPOConfig`."""
    from polyrl_diffusion.config import FlowGRPOConfig

    value = getattr(config.trainer, "plugin_config", None)
    if isinstance(value, FlowGRPOConfig):
        return value
    if value is None:
        return FlowGRPOConfig()
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FlowGRPOConfig), value))


class FlowGRPOWorker(Worker):
    """Engines of model type ``diffusion``; no text tokenizer (the pipeline's text encoder has its own);
    batches of images and SDE transitions; the KL to the reference on the step means; the actor's weight
    copies (``trainer.flow_grpo.ema``; DiffusionNFT's old policy, which the rollout samples with)."""

    model_types = {"actor": "diffusion", "ref": "diffusion", "critic": "diffusion"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        actor = self.actor
        if actor is None or not hasattr(actor, "add_weight_copy") or getattr(actor, "optimizer", None) is None:
            return
        flow = flow_options(self.config)
        enabled, decay, interval = flow.ema_settings()
        if enabled:
            actor.add_weight_copy("ema", ema=(decay, interval))
        if flow.algorithm == "diffusion_nft":
            from polyrl_diffusion.nft import OLD_POLICY

            actor.add_weight_copy(OLD_POLICY)
            actor.rollout_weights = OLD_POLICY

    def serve_rollout_weights(self, name: str | None) -> None:
        """Which weights the actor hands the rollout at the next weight sync: the copy ``name`` (``ema`` for
        validation samples), or ``None`` for the run's default (the trained weights; DiffusionNFT's old policy)."""
        if self.actor is None or not hasattr(self.actor, "weight_copies"):
            return
        if name is None:
            from polyrl_diffusion.nft import OLD_POLICY

            name = OLD_POLICY if OLD_POLICY in self.actor.weight_copies else None
        self.actor.rollout_weights = name

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """Zeros: the diffusion KL is taken on the step means (or velocities) inside the actor update, which asks
        the reference itself; the core's per-step log-prob KL (``actor.use_kl_loss``) gets the real values."""
        if self.config.actor.use_kl_loss:
            return super().compute_ref_log_prob(batch)
        return TensorDict({"log_probs": torch.zeros(batch["response_mask"].shape)}, batch_size=batch.batch_size)

    def load_tokenizer(self) -> Any:
        """None: prompts travel as text and the rollout's pipeline encodes them."""
        return None

    def generate(self, samples: list[dict], sampling: Any, *, validate: bool = False) -> TensorDict | None:
        """The core's generation, each sample named for its random streams first: ``_sample_key`` (the trainer's
        ``step.round.row``, else the row's ``uid``) and ``_repeat``, its index among this rank's repeats of the
        row. The rollout keys its noise by them with the step's seed and the rank, so a run is reproducible
        from ``trainer.seed`` (the uids carry a random suffix) and repeats never share noise, however the
        rank's samples are cut into generation calls."""
        seen: dict[str, int] = {}
        named = []
        for sample in samples:
            key = str(sample.get("_sample_key") or sample.get("uid", ""))
            k = seen.get(key, 0)
            seen[key] = k + 1
            named.append(dict(sample, _sample_key=key, _repeat=k))
        return super().generate(named, sampling, validate=validate)

    def collate_outputs(self, outputs: list[Any]) -> TensorDict:
        """See :func:`collate_images`."""
        return collate_images(outputs)

    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """The core's PPO update (same mini-batches and epochs); with ``trainer.flow_grpo.kl_coef > 0`` the
        reference's step means (``ref_prev_sample_mean``: the adapter-disabled actor, or the ref engine) are
        computed first and the loss adds ``kl_coef`` times the KL on the step means (``kl_form``)."""
        from polyrl.trainer.losses import make_actor_loss
        from polyrl_diffusion.nft import is_nft, update_actor_nft

        if is_nft(self.config):  # D2: DiffusionNFT's forward-process update (nft.py)
            return update_actor_nft(self, batch)
        cfg = self.config.actor
        loss = make_actor_loss(cfg, on_policy=self.update_is_on_policy(batch))
        flow = flow_options(self.config)
        coef = float(flow.kl_coef)
        if coef > 0:
            engine = self.ref if self.ref is not None else self.actor
            batch["ref_prev_sample_mean"] = engine.infer_batch(batch, disable_adapter=self.ref is None)["prev_sample_mean"]
            loss = _with_mean_kl(loss, coef, cfg.loss_agg_mode, flow.kl_form)
        return self.run_update_epochs(self.actor, batch, loss, cfg, shuffle=cfg.shuffle)


def _with_mean_kl(base: Any, coef: float, agg_mode: str, form: str = "flow_grpo") -> Any:
    """``base`` plus ``coef`` times the KL on the step means (:func:`~polyrl_diffusion.algorithms.flow_grpo_kl`):
    ``form="flow_grpo"`` divides by ``2 std_dev_t^2`` (Flow-GRPO's, so ``coef`` is its ``beta``), ``"exact"`` by
    twice the transition's variance (the exact KL of the two Gaussian steps)."""
    from polyrl.algorithms import agg_loss
    from polyrl.trainer.losses import loss_metric
    from polyrl_diffusion.algorithms import flow_grpo_kl

    def loss(out: Any, mb: TensorDict, scale: Any) -> tuple[torch.Tensor, dict[str, float]]:
        value, metrics = base(out, mb, scale)
        cps = "sde_type" in mb.keys() and int(mb["sde_type"][0]) == 1  # cps: std_dev_t is the transition std
        dt = mb["sigmas"] - mb["next_sigmas"] if form == "exact" and not cps else None
        kl = flow_grpo_kl(out["prev_sample_mean"], mb["ref_prev_sample_mean"], out["std_dev_t"], dt=dt)
        kl_loss = agg_loss(kl, mb["response_mask"], agg_mode, loss_scale=scale)
        metrics["actor/kl_mean_loss"] = loss_metric(kl_loss.detach(), mb["response_mask"], agg_mode, scale)
        return value + coef * kl_loss, metrics

    return loss
