"""The flow_grpo worker: the core role worker with image batches and the diffusion model type."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from polyrl.trainer.role_worker import Worker


def collate_images(outputs: list[Any]) -> TensorDict:
    """A batch from diffusion trajectories: every tensor / number extra stacked as a ``[B, ...]`` field,
    strings as non-tensor fields (field list: docs/diffusion.md, "Batch fields")."""
    from polyrl.batch import set_non_tensor

    b = len(outputs)
    batch = TensorDict({}, batch_size=[b])
    keys = sorted({k for o in outputs for k in o.extra})
    for key in keys:
        values = [o.extra.get(key) for o in outputs]
        if all(isinstance(v, torch.Tensor) for v in values) and len({tuple(v.shape) for v in values}) == 1:
            batch[key] = torch.stack(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            batch[key] = torch.tensor([float(v) for v in values])
        else:
            set_non_tensor(batch, key, values)
    return batch


class FlowGRPOWorker(Worker):
    """Engines of model type ``diffusion``; no text tokenizer (the pipeline's text encoder has its own);
    batches of images and SDE transitions; the KL to the reference on the step means."""

    model_types = {"actor": "diffusion", "ref": "diffusion", "critic": "diffusion"}

    def load_tokenizer(self) -> Any:
        """None: prompts travel as text and the rollout's pipeline encodes them."""
        return None

    def collate_outputs(self, outputs: list[Any]) -> TensorDict:
        """See :func:`collate_images`."""
        return collate_images(outputs)

    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """The core's PPO update (same mini-batches and epochs); with ``trainer.flow_grpo.kl_coef > 0`` the
        reference's step means (``ref_prev_sample_mean``: the adapter-disabled actor, or the ref engine) are
        computed first and the loss adds ``kl_coef`` times the exact KL of the two Gaussian transitions."""
        from polyrl.trainer.losses import make_actor_loss
        from polyrl.trainer.role_worker import _run_epochs
        from polyrl_diffusion.nft import is_nft, update_actor_nft

        if is_nft(self.config):  # D2: DiffusionNFT's forward-process update (nft.py)
            return update_actor_nft(self, batch)
        cfg = self.config.actor
        rows = cfg.ppo_mini_batch_size * self.config.rollout.n // self.actor.dp_size
        on_policy = "old_log_probs" not in batch.keys()
        if on_policy and (cfg.ppo_epochs > 1 or rows < batch.batch_size[0]):
            raise RuntimeError("update_actor got no old_log_probs but runs more than one pass over the batch: "
                               "compute them first (compute_log_prob)")
        loss = make_actor_loss(cfg, on_policy=on_policy)
        coef = float(getattr(self.config.trainer.plugin_config, "kl_coef", 0.0) or 0.0)
        if coef > 0:
            engine = self.ref if self.ref is not None else self.actor
            batch["ref_prev_sample_mean"] = engine.infer_batch(batch, disable_adapter=self.ref is None)["prev_sample_mean"]
            loss = _with_mean_kl(loss, coef, cfg.loss_agg_mode)
        return _run_epochs(self.actor, batch, rows, cfg.ppo_epochs, loss, cfg.shuffle, self.actor.dp_rank)


def _with_mean_kl(base: Any, coef: float, agg_mode: str) -> Any:
    """``base`` plus ``coef`` times Flow-GRPO's KL on the step means (D2's :func:`flow_grpo_kl`, exact form)."""
    from polyrl.algorithms import agg_loss
    from polyrl_diffusion.algorithms import flow_grpo_kl

    def loss(out: Any, mb: TensorDict, scale: Any) -> tuple[torch.Tensor, dict[str, float]]:
        value, metrics = base(out, mb, scale)
        kl = flow_grpo_kl(out["prev_sample_mean"], mb["ref_prev_sample_mean"], out["std_dev_t"],
                          dt=mb["sigmas"] - mb["next_sigmas"])
        kl_loss = agg_loss(kl, mb["response_mask"], agg_mode, loss_scale=scale)
        metrics["actor/kl_mean_loss"] = float(kl_loss.detach())
        return value + coef * kl_loss, metrics

    return loss
