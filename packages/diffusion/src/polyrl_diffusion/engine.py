"""Engine ``diffusers`` (model type ``diffusion``): FSDP2 over a diffusers transformer.

A subclass of polyrl-engine-fsdp's :class:`~polyrl_engine_fsdp.engine.FSDPEngine`, through its public
extension points only (``load_model``, ``apply_lora``, ``wrap_model``, ``forward_micro_batch``): sharding
(FSDP2, HSDP, or DDP-like all-reduce), mixed precision, CPU offload, the optimizer and LR schedule, gradient
clipping, micro-batching with rank padding, sharded atomic checkpoints and weight buckets for the rollout
all come from there. What differs is the model and its forward pass: for each row and trained
step it predicts the velocity at ``(latents, sigmas)`` (CFG-combined when the row was sampled with
guidance) and, when the batch has ``next_latents``, recomputes the Flow-GRPO step's Gaussian mean and
the log-prob of the sampled transition with :mod:`polyrl_diffusion.sampler` — the same code the rollout
sampled with, so on-policy the ratio is exactly 1. The reference policy is the adapter-disabled model.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from polyrl.batch import require_fields
from polyrl.errors import ConfigError
from polyrl_diffusion.models import TextEmbeddings, load_transformer, pipeline_family, transformer_velocity
from polyrl_diffusion.sampler import guided, sde_step_mean, step_log_prob
from polyrl_diffusion.weight_copies import WeightCopy
from polyrl_engine_fsdp.engine import FSDPEngine, full_tensor

logger = logging.getLogger(__name__)

#: Fields every forward pass reads.
NEEDED = ("latents", "sigmas", "prompt_embeds", "pooled_prompt_embeds", "response_mask")
#: peft target modules for ``lora.target_modules: [all-linear]``: the attention projections (Flow-GRPO's choice).
ATTENTION_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
#: What the forward pass returns per row and trained step (see :class:`DiffusionRoot`).
OUTPUT_KEYS = ("log_probs", "entropy", "velocity", "prev_sample_mean", "std_dev_t")


def _concat(a: TextEmbeddings, b: TextEmbeddings) -> TextEmbeddings:
    return TextEmbeddings(torch.cat([a.prompt_embeds, b.prompt_embeds]), torch.cat([a.pooled, b.pooled]))


class DiffusionRoot(nn.Module):
    """The FSDP root: the transformer (as ``model``, so parameter names map to diffusers names) and the
    Flow-GRPO step around it.

    ``forward(inputs)`` takes a micro-batch's tensors and returns ``velocity`` ``[b, T, C, H, W]`` and,
    with ``next_latents``, ``log_probs``/``entropy``/``std_dev_t`` ``[b, T]`` and ``prev_sample_mean``.
    """

    def __init__(self, model: nn.Module, family: str) -> None:
        super().__init__()
        self.model = model
        self.family = family

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lat = inputs["latents"]
        b, t = lat.shape[:2]
        x = lat.reshape(b * t, *lat.shape[2:])
        sigma = inputs["sigmas"].reshape(-1)
        cond = TextEmbeddings(inputs["prompt_embeds"].repeat_interleave(t, 0),
                              inputs["pooled_prompt_embeds"].repeat_interleave(t, 0))
        scale = 1.0
        uncond = None
        if "guidance_scale" in inputs and "negative_prompt_embeds" in inputs:
            scales = inputs["guidance_scale"].float()
            scale = float(scales[0])
            if not bool((scales == scale).all()):
                raise ValueError("a micro-batch mixes guidance scales; sample every row of a step with one cfg_scale")
            if scale != 1.0:
                uncond = TextEmbeddings(inputs["negative_prompt_embeds"].repeat_interleave(t, 0),
                                        inputs["negative_pooled_prompt_embeds"].repeat_interleave(t, 0))

        embedded = 1.0  # a guidance-distilled FLUX's embedded guidance, as the rollout sampled with it
        if "embedded_guidance" in inputs:
            values = inputs["embedded_guidance"].float()
            embedded = float(values[0])
            if not bool((values == embedded).all()):
                raise ValueError("a micro-batch mixes embedded guidance values; sample every row of a step with one "
                                 "trainer.flow_grpo.embedded_guidance")

        def velocity_fn(xx: torch.Tensor, ss: torch.Tensor, emb: TextEmbeddings) -> torch.Tensor:
            return transformer_velocity(self.model, self.family, xx, ss, emb, embedded)

        v = guided(velocity_fn, x, sigma, cond, uncond, scale, _concat)
        out = {"velocity": v.reshape(b, t, *v.shape[1:])}
        if "next_latents" in inputs:
            nxt = inputs["next_latents"].reshape(b * t, *lat.shape[2:]).float()
            kind = 0  # the rollout's SDE (sampler.SDE_TYPES): Flow-GRPO's, cps or DanceGRPO's
            if "sde_type" in inputs:
                kinds = inputs["sde_type"]
                kind = int(kinds[0])
                if not bool((kinds == kind).all()):
                    raise ValueError("a micro-batch mixes SDE types; sample every row of a run with one sde_type")
            mean, std_dev_t, std = sde_step_mean(x.float(), v, sigma, inputs["next_sigmas"].reshape(-1),
                                                 inputs["noise_levels"].reshape(-1), kind)
            logp = step_log_prob(nxt, mean, std, kind)
            safe = torch.where(std > 0, std, torch.ones_like(std))
            entropy = torch.where(std > 0, 0.5 * torch.log(2 * math.pi * math.e * safe**2), torch.zeros_like(std))
            out.update(log_probs=logp.reshape(b, t), entropy=entropy.reshape(b, t).detach(),
                       prev_sample_mean=mean.reshape(b, t, *mean.shape[1:]), std_dev_t=std_dev_t.reshape(b, t))
        else:  # DiffusionNFT-style batches: velocities only; zero log-probs keep the shapes of the protocol
            zero = v.new_zeros(b, t) + 0.0 * v.reshape(b, t, -1).sum(-1)
            out.update(log_probs=zero, entropy=zero.detach())
        return out


class DiffusersEngine(FSDPEngine):
    """:class:`polyrl.protocols.Engine` over the transformer of a flow-matching pipeline folder.

    Built as ``DiffusersEngine(role_config, role=..., model_type="diffusion", platform=...)``; the role's
    ``model.path`` is a pipeline folder (:mod:`polyrl_diffusion.models`). ``temperature`` is accepted and
    ignored (no logits). ``infer_batch`` returns ``log_probs``, ``entropy``, ``velocity``,
    ``prev_sample_mean`` and ``std_dev_t``; ``disable_adapter=True`` gives the reference policy of a LoRA actor.
    """

    required_fields = NEEDED
    config_section = "diffusers"

    def __init__(self, config: Any, *, role: str, model_type: str = "diffusion", platform: Any = None) -> None:
        if model_type != "diffusion":
            raise ConfigError(f"{role}.engine=diffusers trains flow-matching image models (model type 'diffusion'), "
                              f"not {model_type!r}; use engine fsdp for language models")
        if config.use_dynamic_bsz:
            raise ConfigError(f"{role}.use_dynamic_bsz=true: the diffusers engine has fixed-size images; "
                              f"use {role}.micro_batch_size")
        #: EMA / old-policy copies of the trained weights (:meth:`add_weight_copy`), and the one
        #: :meth:`weights_for_rollout` serves (``None``: the trained weights themselves)
        self.weight_copies: dict[str, WeightCopy] = {}
        self.rollout_weights: str | None = None
        super().__init__(config, role=role, model_type=model_type, platform=platform)

    # ------------------------------------------------------------------ construction (FSDPEngine's extension points)
    def load_model(self, dtype: torch.dtype) -> nn.Module:
        """The pipeline's transformer in ``dtype`` (gradient checkpointing on when asked); the pipeline family
        (``sd3``, ``flux``...) picks the forward."""
        mcfg = self.config.model
        key = f"{self.role}.model.path"
        self.family, _ = pipeline_family(mcfg.path, key)
        model = load_transformer(mcfg.path, key, dtype)
        self.hf_config = dict(model.config)
        if mcfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return model

    def apply_lora(self, model: nn.Module, lora: Any) -> nn.Module:
        """peft LoRA on the transformer; ``all-linear`` means the attention projections (Flow-GRPO's choice)."""
        from peft import LoraConfig, get_peft_model

        targets = list(lora.target_modules)
        if targets == ["all-linear"]:
            names = {n.rsplit(".", 1)[-1] if not n.endswith("to_out.0") else "to_out.0" for n, _ in model.named_modules()}
            targets = [t for t in ATTENTION_TARGETS if t in names]
        try:
            return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                    target_modules=targets, bias="none"))
        except ValueError as exc:
            raise ConfigError(f"{self.role}.model.lora.target_modules={list(lora.target_modules)} matches no module "
                              f"of the transformer ({exc})") from None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """:class:`DiffusionRoot`: the transformer and the Flow-GRPO step around it."""
        return DiffusionRoot(model, self.family)

    # ------------------------------------------------------------------ forward passes
    def forward_micro_batch(self, mb: TensorDict, temperature: float, compute_entropy: bool
                            ) -> tuple[dict[str, torch.Tensor], TensorDict]:
        """Every tensor field of ``mb`` on the device into :class:`DiffusionRoot` (see :data:`OUTPUT_KEYS`);
        ``mb`` itself is what the loss sees (no trimming: images have no padding columns)."""
        inputs = {k: mb[k].to(self.device) for k in mb.keys() if isinstance(mb.get(k), torch.Tensor)}
        return self.module(inputs), mb

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, *, temperature: float = 1.0, compute_entropy: bool = False,
                    disable_adapter: bool = False) -> TensorDict:
        """Per row and trained step: ``log_probs``, ``entropy``, ``std_dev_t`` ``[B, T]`` and ``velocity``,
        ``prev_sample_mean`` ``[B, T, C, H, W]`` (the last two without ``next_latents``: velocity only)."""
        require_fields(batch, NEEDED, f"{self.role} engine infer_batch")
        self.module.eval()
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        ctx = self.module.model.disable_adapter() if disable_adapter and self.lora else _null()
        with ctx:
            for rows in self.split_micro_batches(batch, False):
                if rows is None:
                    self.forward_micro_batch(self.padding_micro_batch(batch), temperature, False)
                    continue
                out, _ = self.forward_micro_batch(batch[rows], temperature, compute_entropy)
                for k, v in out.items():
                    parts.setdefault(k, []).append((rows, v.float().cpu()))
        result = {}
        for k, chunks in parts.items():
            full = torch.zeros(batch.batch_size[0], *chunks[0][1].shape[1:])
            for rows, v in chunks:
                full[rows] = v
            result[k] = full
        mask = batch["response_mask"].float()
        for k in ("log_probs", "entropy"):
            result[k] = result[k] * mask
        return TensorDict(result, batch_size=batch.batch_size)

    # ------------------------------------------------------------------ export
    def export_hf(self, path: str) -> None:
        """A pipeline folder at ``path``: the source folder's other components (text encoders, tokenizer, VAE,
        scheduler, ``model_index.json``) copied, and ``transformer/`` with the trained weights (LoRA merged, or
        with ``diffusers.lora_export: adapter`` the source's transformer and the peft adapter folder
        ``transformer_lora/``, for ``PeftModel.from_pretrained``). With an EMA (``trainer.flow_grpo.ema``) the
        EMA's weights are written, as the references save theirs. Collective."""
        if "ema" in self.weight_copies and not getattr(self, "_exporting_ema", False):
            self._exporting_ema = True
            try:
                with self.weight_copy("ema"):
                    return self.export_hf(path)
            finally:
                self._exporting_ema = False
        out = Path(path)
        adapter = self.lora and self.fsdp.lora_export == "adapter"
        if adapter:  # peft's own names (with the adapter name), which its save_pretrained expects
            source = ((n[len("model."):], full_tensor(p)) for n, p in self.module.named_parameters() if p.requires_grad)
        else:
            source = self.full_parameters()
        tensors = {}
        for name, tensor in source:  # every rank gathers, rank 0 keeps
            if self.rank == 0:
                tensors[name] = tensor.detach().cpu().contiguous()
        if self.rank == 0:
            src = Path(self.config.model.path)
            out.mkdir(parents=True, exist_ok=True)
            for item in src.iterdir():
                if item.name in ("transformer", "transformer_lora", "polyrl_export.json"):  # written below
                    continue
                target = out / item.name
                if item.is_dir():
                    shutil.copytree(item, target, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, target)
            if adapter:  # adapter_config.json + adapter_model.safetensors: PeftModel.from_pretrained loads it
                self.module.model.save_pretrained(str(out / "transformer_lora"), state_dict=tensors,
                                                  save_embedding_layers=False)
                shutil.copytree(src / "transformer", out / "transformer", dirs_exist_ok=True)
            else:
                model = load_transformer(src, f"{self.role}.model.path")
                result = model.load_state_dict(tensors, strict=False)
                buffers = {n for n, _ in model.named_buffers()}
                if result.unexpected_keys or set(result.missing_keys) - buffers:
                    raise RuntimeError(f"export {out}: weights do not match the transformer (missing "
                                       f"{sorted(set(result.missing_keys) - buffers)}, unexpected {result.unexpected_keys})")
                model.save_pretrained(str(out / "transformer"))
            (out / "polyrl_export.json").write_text(json.dumps({"step": self.step, "role": self.role}))
        if dist.is_initialized():
            dist.barrier()

    def offload(self) -> None:
        """As the fsdp engine (a no-op on CPU), the weight copies too."""
        super().offload()
        if self.device.type != "cpu" and not self.fsdp.param_offload:
            for copy in self.weight_copies.values():
                copy.to("cpu")

    def onload(self) -> None:
        """As the fsdp engine, the weight copies too."""
        super().onload()
        if self.device.type != "cpu" and not self.fsdp.param_offload:
            for copy in self.weight_copies.values():
                copy.to(self.device)

    # ------------------------------------------------------------------ weight copies (EMA, DiffusionNFT's old policy)
    def trainable_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of the trained parameters (the LoRA tensors of a LoRA actor), this rank's shards."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def add_weight_copy(self, name: str, *, ema: tuple[float, int] | None = None) -> None:
        """Keep a copy ``name`` of the trained weights as they are now; ``ema=(decay, update_interval)`` updates it
        after every optimizer step (:meth:`WeightCopy.after_optimizer_step`). Saved with the checkpoints."""
        self.weight_copies[name] = WeightCopy(self.trainable_parameters(), ema=ema)

    def update_weight_copy(self, name: str, weight: float) -> None:
        """``copy += weight * (w - copy)`` (DiffusionNFT's soft update with ``weight = 1 - decay``)."""
        self.weight_copies[name].lerp_(self.trainable_parameters(), weight)

    def weight_copy(self, name: str) -> Any:
        """A context manager inside which the model holds the copy ``name`` (forward passes, export)."""
        return self.weight_copies[name].swapped_in(self.trainable_parameters())

    def train_batch(self, batch: TensorDict, loss_fn: Any, *, temperature: float = 1.0) -> dict[str, float]:
        """The fsdp engine's optimizer step, then the EMA update (when an EMA copy is kept)."""
        metrics = super().train_batch(batch, loss_fn, temperature=temperature)
        if self.weight_copies:
            params = self.trainable_parameters()
            for copy in self.weight_copies.values():
                copy.after_optimizer_step(params, self.step)
        return metrics

    def weights_for_rollout(self, bucket_bytes: int = 512 << 20) -> Any:
        """The fsdp engine's buckets, of the copy :attr:`rollout_weights` names when set (DiffusionNFT samples with
        its old policy; validation with the EMA). Collective."""
        if self.rollout_weights is None:
            yield from super().weights_for_rollout(bucket_bytes)
            return
        with self.weight_copy(self.rollout_weights):
            for bucket in super().weights_for_rollout(bucket_bytes):
                # copies: a gathered tensor may share the parameter's storage, which gets its own values back
                yield [(n, t.clone()) for n, t in bucket]

    def save_checkpoint(self, path: str) -> None:
        """The fsdp engine's checkpoint, and this rank's part of each weight copy (``weight_copies_rank<r>.pt``
        inside it; the trainer renames the whole step folder into place once every file is written)."""
        super().save_checkpoint(path)
        if self.weight_copies:
            torch.save({name: copy.state_dict() for name, copy in self.weight_copies.items()},
                       Path(path) / f"weight_copies_rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote. A checkpoint written without the copies leaves them as
        copies of the restored weights, with a warning."""
        super().load_checkpoint(path)
        if not self.weight_copies:
            return
        file = Path(path) / f"weight_copies_rank{self.rank}.pt"
        params = self.trainable_parameters()
        state = torch.load(file, map_location="cpu", weights_only=True) if file.exists() else {}
        for name, copy in self.weight_copies.items():
            if name in state:
                copy.load_state_dict(state[name])
            else:
                logger.warning("checkpoint %s holds no %r weight copy: it restarts from its weights", path, name)
                copy.lerp_(params, 1.0)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

