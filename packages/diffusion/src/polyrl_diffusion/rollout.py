"""Rollout ``diffusers``: text-to-image sampling with Flow-GRPO's SDE and per-step log-probs.

Implements :class:`polyrl.protocols.Rollout`. A request's text arrives in ``multi_modal`` (the
``diffusion`` agent loop puts ``prompt``, ``negative_prompt``, ``train_step`` and ``validate`` there;
``prompt_ids`` stay empty). Each result carries in ``extra`` what training needs (field names and
shapes: docs/diffusion.md, "Batch fields"): the trained steps' latents, sigmas, noise levels and
log-probs, the text embeddings, the clean latents and the decoded image as ``uint8``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from polyrl.protocols import GenerationRequest, GenerationResult, RolloutCapabilities
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import FlowModel, TextEmbeddings, load_flow_model
from polyrl_diffusion.sampler import group_seed, guided, plan_steps, sample_trajectory, sigma_schedule

logger = logging.getLogger(__name__)


def _concat(a: TextEmbeddings, b: TextEmbeddings) -> TextEmbeddings:
    return TextEmbeddings(torch.cat([a.prompt_embeds, b.prompt_embeds]), torch.cat([a.pooled, b.pooled]))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DiffusersRollout:
    """Samples images from a flow-matching pipeline folder (see :mod:`polyrl_diffusion.models`)."""

    capabilities = RolloutCapabilities(sleep=False, async_generate=False, log_probs=True, lora_adapter=False,
                                       tensor_parallel=False, weight_formats=("hf",))

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any = None, platform: Any = None) -> None:
        self.config = config
        plugin = getattr(config, "plugin_config", None)
        self.options: DiffusersRolloutConfig = plugin if isinstance(plugin, DiffusersRolloutConfig) else DiffusersRolloutConfig()
        self.sampler: FlowGRPOConfig = self.options.sampler
        device = platform.current_device() if platform is not None else torch.device("cpu")
        self.model: FlowModel = load_flow_model(model_path, key="actor.model.path", device=device)
        self.device = device
        self.max_model_len = None
        self._params = dict(self.model.transformer.named_parameters())

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``n`` images per request, grouped by request in input order (see the module docstring)."""
        rows: list[tuple[GenerationRequest, int]] = [(r, k) for r in requests for k in range(r.sampling_params.n)]
        results: list[GenerationResult] = []
        chunk = max(1, self.options.max_batch_size)
        groups: dict[tuple[bool, int, Any], list[int]] = {}
        for i, (req, _) in enumerate(rows):
            mm = req.multi_modal or {}
            groups.setdefault((bool(mm.get("validate", False)), int(mm.get("train_step", 0)),
                               req.sampling_params.seed), []).append(i)
        by_row: dict[int, GenerationResult] = {}
        for (validate, train_step, seed), members in groups.items():
            for start in range(0, len(members), chunk):
                part = members[start : start + chunk]
                for i, res in zip(part, self._generate_rows([rows[i] for i in part], validate, train_step, seed)):
                    by_row[i] = res
        results = [by_row[i] for i in range(len(rows))]
        return results

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """``generate`` for one request, in a thread (the trainer batches concurrent calls itself)."""
        return await asyncio.to_thread(self.generate, [request])

    def _generate_rows(self, rows: list[tuple[GenerationRequest, int]], validate: bool, train_step: int,
                       seed: int | None) -> list[GenerationResult]:
        cfg = self.sampler
        base = seed if seed is not None else random.getrandbits(62)
        rng = random.Random(group_seed(base, f"plan:{train_step}"))  # same window on every rank
        plan = plan_steps(cfg, train_step, validate=validate, rng=rng)
        row_rng = random.Random(group_seed(base, f"rows:{_rank()}:{rows[0][0].request_id}"))
        if validate:
            trained: list[list[int]] = [[] for _ in rows]
        else:
            window = [i for i, s in enumerate(plan.sde) if s]
            count = len(plan.trained_indices)
            trained = [sorted(row_rng.sample(window, count)) for _ in rows]
        prompts = [str((r.multi_modal or {}).get("prompt", "")) for r, _ in rows]
        negatives = [str((r.multi_modal or {}).get("negative_prompt") or cfg.negative_prompt) for r, _ in rows]
        c, h, w = self.model.latent_shape(cfg.height, cfg.width)
        noise = []
        seen: dict[str, int] = {}
        for req, _ in rows:
            gid = str(req.request_id or "")
            k = seen.get(gid, 0)
            seen[gid] = k + 1
            key = f"group:{gid}" if cfg.dance_grpo.enable and not validate else f"row:{_rank()}:{gid}:{k}"
            gen = torch.Generator().manual_seed(group_seed(base, key))
            noise.append(torch.randn(c, h, w, generator=gen))
        x = torch.stack(noise).to(self.device)
        cond = self.model.encode(prompts)
        scale = float(cfg.cfg_scale)
        uncond = self.model.encode(negatives) if scale > 1.0 else None
        sigmas = sigma_schedule(plan.num_steps, self.model.sigma_shift((h, w)))

        def velocity(lat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return guided(self.model.velocity, lat, sigma, cond, uncond, scale, _concat)

        step_gen = torch.Generator(device=self.device).manual_seed(group_seed(base, f"steps:{_rank()}:{rows[0][0].request_id}"))
        traj = sample_trajectory(velocity, x, sigmas, plan, trained, generator=step_gen)
        images = self.model.decode(traj.x0.to(self.device))
        train_cfg = scale if (cfg.train_cfg and uncond is not None) else 1.0
        out = []
        for i, (req, k) in enumerate(rows):
            extra: dict[str, Any] = {
                "images": images[i],
                "x0": traj.x0[i],
                "initial_noise": traj.initial_noise[i],
                "prompt": prompts[i],
                "negative_prompt": negatives[i],
            }
            if not validate:
                extra.update({
                    "latents": traj.latents[i], "next_latents": traj.next_latents[i], "sigmas": traj.sigmas[i],
                    "next_sigmas": traj.next_sigmas[i], "noise_levels": traj.noise_levels[i],
                    "step_index": traj.step_index[i], "rollout_log_probs": traj.log_probs[i],
                    "response_mask": torch.ones(traj.log_probs.shape[1], dtype=torch.long),
                    "guidance_scale": float(train_cfg),
                    "prompt_embeds": cond.prompt_embeds[i].cpu(), "pooled_prompt_embeds": cond.pooled[i].cpu(),
                })
                if train_cfg > 1.0:
                    extra["negative_prompt_embeds"] = uncond.prompt_embeds[i].cpu()
                    extra["negative_pooled_prompt_embeds"] = uncond.pooled[i].cpu()
            out.append(GenerationResult(prompt_ids=[], response_ids=[], log_probs=[], finish_reason="stop",
                                        request_id=req.request_id, sample_index=k, extra=extra))
        return out

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformer weights (diffusers names) in; ``KeyError``/``ValueError`` name a bad tensor, and
        nothing is changed when any tensor of the call is bad."""
        pending = []
        for name, tensor in named_tensors:
            if name not in self._params:
                raise KeyError(f"diffusers rollout: weight {name!r} matches no parameter of the transformer")
            param = self._params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"diffusers rollout: weight {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"transformer's is {tuple(param.shape)}")
            pending.append((param, tensor))
        with torch.no_grad():
            for param, tensor in pending:
                param.copy_(tensor.to(param.device, param.dtype))

    def sleep(self, level: int = 1) -> None:
        """No-op: the transformer is small next to the engine's training state (``capabilities.sleep`` is False)."""

    def wake_up(self) -> None:
        """No-op (see :meth:`sleep`)."""

    def shutdown(self) -> None:
        """Nothing runs outside this process."""
