"""Rollout ``diffusers``: text-to-image sampling with Flow-GRPO's SDE and per-step log-probs.

Implements :class:`polyrl.protocols.Rollout`. A request's text arrives in ``multi_modal`` (the
``diffusion`` agent loop puts ``prompt``, ``negative_prompt``, ``train_step`` and ``validate`` there;
``prompt_ids`` stay empty; the flow_grpo worker adds ``sample_key`` and ``repeat``, a sample's identity for its
random streams). Each result carries in ``extra`` what training needs (field names and
shapes: docs/diffusion.md, "Batch fields"): the trained steps' latents, sigmas, noise levels and
log-probs, the text embeddings, the clean latents and the decoded image as ``uint8``.

Randomness: every draw comes from the request's ``sampling_params.seed`` (the trainer's
``trainer.seed * 1_000_003 + step``), the data-parallel rank and the samples' identities (``sample_key`` and
``repeat``; a request without them: its ``request_id`` and its position among the rows of the call sharing
it). A sample's initial noise depends on nothing else; the SDE noise and the trained-step subsets are drawn
per chunk of ``max_batch_size`` rows (keyed by the chunk's first sample), so the same seed and the same
batching settings give the same images. Only a request without a seed draws a fresh one.

Text embeddings are computed once per distinct prompt of a call and kept in an LRU
(``rollout.diffusers.text_cache_size``): the text encoder is frozen (the engine trains the transformer and
:meth:`DiffusersRollout.update_weights` takes transformer weights only), so an entry never goes stale. A model
whose prompts have their own lengths (QwenImage) keeps each prompt's rows unpadded and pads a batch's to
``rollout.diffusers.text_length`` (or its longest) with a mask (``prompt_embeds_mask``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.protocols import GenerationRequest, GenerationResult, RolloutCapabilities
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import FlowModel, TextEmbeddings, guidance_norm, load_flow_model, pad_text
from polyrl_diffusion.sampler import StepPlan, Trajectory, group_seed, guided, plan_steps, sample_trajectory

logger = logging.getLogger(__name__)


def _concat(a: TextEmbeddings, b: TextEmbeddings) -> TextEmbeddings:
    return pad_text([a, b])


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _identities(rows: Sequence[tuple[GenerationRequest, int]]) -> list[tuple[str, int]]:
    """``(key, repeat)`` of each row: what its random streams are keyed by (with the seed and the rank).

    A request with ``multi_modal["sample_key"]`` and ``["repeat"]`` (set by the flow_grpo worker: the trainer's
    deterministic sample key and the repeat's index among this rank's repeats of the row) uses them; otherwise
    the ``request_id`` and the row's position among the rows of this call with the same id (a request's
    ``n`` samples and the repeats of a GRPO group sent as separate requests get different noise).
    """
    out: list[tuple[str, int]] = []
    seen: dict[str, int] = {}
    for req, k in rows:
        mm = req.multi_modal or {}
        if mm.get("sample_key") is not None and mm.get("repeat") is not None:
            out.append((str(mm["sample_key"]), int(mm["repeat"]) * req.sampling_params.n + k))
            continue
        gid = str(req.request_id or "")
        count = seen.get(gid, 0)
        seen[gid] = count + 1
        out.append((gid, count))
    return out


@dataclass
class SampleBatch:
    """One chunk of rows to integrate, fixed by :meth:`DiffusersRollout.generate` before any model runs: the
    prompts and negative prompts, the initial noise ``[N, C, H, W]`` (CPU), the sigma schedule, the step plan and
    each row's trained steps, the CFG scale, the embedded guidance value and the seed of the SDE noise. Another
    engine (the ``vllm_omni`` rollout) integrates the same batch, so what is sampled stays polyrl's decision."""

    prompts: list[str]
    negatives: list[str]
    noise: torch.Tensor
    sigmas: torch.Tensor
    plan: StepPlan
    trained: list[list[int]]
    cfg_scale: float
    embedded_guidance: float
    seed: int


def _tag(key: str, repeat: int) -> str:
    """A sample's name in seed keys (``key`` alone for the first repeat)."""
    return key if repeat == 0 else f"{key}:{repeat}"


class DiffusersRollout:
    """Samples images from a flow-matching pipeline folder (see :mod:`polyrl_diffusion.models`)."""

    capabilities = RolloutCapabilities(sleep=True, async_generate=False, log_probs=True, lora_adapter=False,
                                       tensor_parallel=False, weight_formats=("hf",))

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any = None, platform: Any = None) -> None:
        self.config = config
        plugin = getattr(config, "plugin_config", None)
        self.options: DiffusersRolloutConfig = plugin if isinstance(plugin, DiffusersRolloutConfig) else DiffusersRolloutConfig()
        self.sampler: FlowGRPOConfig = self.options.sampler
        device = platform.current_device() if platform is not None else torch.device("cpu")
        self.model: FlowModel = load_flow_model(model_path, key="actor.model.path", device=device)
        self.device = device
        self.platform = platform
        self._asleep = False
        self.max_model_len = None
        self._params = dict(self.model.transformer.named_parameters())
        self._text_cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._text_lock = threading.Lock()
        self._keep_norm = guidance_norm(self.model.family)

    # ------------------------------------------------------------------ text
    def embed(self, prompts: Sequence[str]) -> TextEmbeddings:
        """Text embeddings of ``prompts`` (one row each, on the rollout's device).

        Each distinct string is encoded once per call (the new ones in one text-encoder call) and kept in an
        LRU of ``text_cache_size`` entries; a GRPO batch repeats each prompt ``n`` times. The rows are exactly
        :meth:`FlowModel.encode` of the distinct prompts (on CPU, GEMM kernels of fewer than 4 rows may round
        the pooled embedding differently from a larger batch, by about 1e-7). A model whose prompts have their own
        lengths (QwenImage) keeps each prompt's rows unpadded; the result is padded to
        ``rollout.diffusers.text_length`` (or the longest row) with a mask.
        """
        unique = list(dict.fromkeys(str(p) for p in prompts))
        found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with self._text_lock:
            for p in unique:
                hit = self._text_cache.get(p)
                if hit is not None:
                    self._text_cache.move_to_end(p)
                    found[p] = hit
        missing = [p for p in unique if p not in found]
        if missing:
            enc = self.model.encode(missing)
            size = max(0, int(self.options.text_cache_size))
            lengths = enc.mask.sum(-1).tolist() if enc.mask is not None else [enc.prompt_embeds.shape[1]] * len(missing)
            with self._text_lock:
                for j, p in enumerate(missing):
                    rows = enc.prompt_embeds[j, : int(lengths[j])]  # a masked family's prompt, unpadded
                    # a copy per entry: a view would keep the whole encoder batch alive after eviction
                    found[p] = (rows.clone(), enc.pooled[j].clone()) if size else (rows, enc.pooled[j])
                    if size:
                        self._text_cache[p] = found[p]
                        self._text_cache.move_to_end(p)
                while len(self._text_cache) > size:
                    self._text_cache.popitem(last=False)
        if not self.model.masked_text:
            return TextEmbeddings(torch.stack([found[str(p)][0] for p in prompts]),
                                  torch.stack([found[str(p)][1] for p in prompts]))
        length = int(self.options.text_length)
        for p in unique:
            if length and found[p][0].shape[0] > length:
                raise ValueError(f"prompt {p!r} is {found[p][0].shape[0]} text tokens long, more than "
                                 f"rollout.diffusers.text_length={length}: raise it (0: the trainer sets it from the "
                                 "data's longest prompt)")
        rows = []
        for p in prompts:
            embeds, pooled = found[str(p)]
            ones = torch.ones(1, embeds.shape[0], dtype=torch.long, device=embeds.device)
            rows.append(TextEmbeddings(embeds[None], pooled[None], ones))
        return pad_text(rows, length)

    @property
    def cached_prompts(self) -> int:
        """How many prompts' text embeddings the LRU holds."""
        with self._text_lock:
            return len(self._text_cache)

    def clear_text_cache(self) -> None:
        """Forget the cached text embeddings (for a caller that changes the text encoder in place)."""
        with self._text_lock:
            self._text_cache.clear()

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``n`` images per request, grouped by request in input order (see the module docstring). A sleeping
        rollout wakes up first."""
        if self._asleep:
            self.wake_up()
        rows: list[tuple[GenerationRequest, int]] = [(r, k) for r in requests for k in range(r.sampling_params.n)]
        idents = _identities(rows)
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
                out = self._generate_rows([rows[i] for i in part], [idents[i] for i in part], validate, train_step, seed)
                for i, res in zip(part, out):
                    by_row[i] = res
        return [by_row[i] for i in range(len(rows))]

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """``generate`` for one request, in a thread (the trainer batches concurrent calls itself)."""
        return await asyncio.to_thread(self.generate, [request])

    def _generate_rows(self, rows: list[tuple[GenerationRequest, int]], idents: list[tuple[str, int]], validate: bool,
                       train_step: int, seed: int | None) -> list[GenerationResult]:
        cfg = self.sampler
        base = seed if seed is not None else random.getrandbits(62)
        rank = _rank()
        rng = random.Random(group_seed(base, f"plan:{train_step}"))  # same window on every rank
        plan = plan_steps(cfg, train_step, validate=validate, rng=rng)
        first = _tag(*idents[0])  # the chunk's streams follow its first sample, not the chunk's position
        row_rng = random.Random(group_seed(base, f"rows:{rank}:{first}"))
        if validate:
            trained: list[list[int]] = [[] for _ in rows]
        elif plan.random_subset:  # DanceGRPO: each image its own random subset of the SDE steps
            window = [i for i, s in enumerate(plan.sde) if s]
            count = len(plan.trained_indices)
            trained = ([list(window) for _ in rows] if count == len(window)
                       else [sorted(row_rng.sample(window, count)) for _ in rows])
        else:
            trained = [plan.trained_indices for _ in rows]
        prompts = [str((r.multi_modal or {}).get("prompt", "")) for r, _ in rows]
        negatives = [str((r.multi_modal or {}).get("negative_prompt") or cfg.negative_prompt) for r, _ in rows]
        c, h, w = self.latent_shape(cfg.height, cfg.width)
        noise = []
        shared = cfg.shares_initial_noise() and not validate  # one noise per prompt group (same_initial_noise)
        for gid, k in idents:
            key = f"group:{gid}" if shared else f"row:{rank}:{gid}:{k}"
            gen = torch.Generator().manual_seed(group_seed(base, key))
            noise.append(torch.randn(c, h, w, generator=gen))
        scale = float(cfg.cfg_scale)
        embedded = float(cfg.embedded_guidance)
        sigmas = self.sigma_schedule(plan.num_steps, (h, w))  # a diffusers folder: its scheduler's own
        traj, images, cond, uncond = self.sample(SampleBatch(
            prompts=prompts, negatives=negatives, noise=torch.stack(noise), sigmas=sigmas, plan=plan, trained=trained,
            cfg_scale=scale, embedded_guidance=embedded, seed=group_seed(base, f"steps:{rank}:{first}")))
        train_cfg = scale if (cfg.train_cfg and uncond is not None) else 1.0
        with_neg = train_cfg > 1.0 and uncond is not None
        if not validate:  # one device-to-host copy per field; the rows below are views
            embeds, pooled = cond.prompt_embeds.cpu(), cond.pooled.cpu()
            neg_embeds = uncond.prompt_embeds.cpu() if with_neg and uncond is not None else None
            neg_pooled = uncond.pooled.cpu() if with_neg and uncond is not None else None
            mask = cond.mask.cpu() if cond.mask is not None else None
            neg_mask = uncond.mask.cpu() if with_neg and uncond is not None and uncond.mask is not None else None
            ones = torch.ones(traj.log_probs.shape[1], dtype=torch.long)
            schedule = sigmas.float().cpu()  # the whole training schedule (DiffusionNFT trains on its times)
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
                    "response_mask": ones, "guidance_scale": float(train_cfg), "train_step": int(train_step),
                    "embedded_guidance": embedded, "sde_type": plan.sde_type, "schedule_sigmas": schedule,
                    "prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i],
                })
                if neg_embeds is not None and neg_pooled is not None:
                    extra["negative_prompt_embeds"] = neg_embeds[i]
                    extra["negative_pooled_prompt_embeds"] = neg_pooled[i]
                if mask is not None:  # QwenImage: the text's own length
                    extra["prompt_embeds_mask"] = mask[i]
                if neg_mask is not None:
                    extra["negative_prompt_embeds_mask"] = neg_mask[i]
            out.append(GenerationResult(prompt_ids=[], response_ids=[], log_probs=[], finish_reason="stop",
                                        request_id=req.request_id, sample_index=k, extra=extra))
        return out

    def latent_shape(self, height: int = 0, width: int = 0) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents for ``height x width`` pixels (:meth:`FlowModel.latent_shape`)."""
        return self.model.latent_shape(height, width)

    def sigma_schedule(self, num_steps: int, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The sampler's ``num_steps + 1`` sigmas (:meth:`FlowModel.sigma_schedule`: a diffusers folder's
        scheduler's own)."""
        return self.model.sigma_schedule(num_steps, latent_hw)

    def sample(self, batch: SampleBatch) -> tuple[Trajectory, torch.Tensor, TextEmbeddings, TextEmbeddings | None]:
        """Integrate ``batch``: the trajectory, the images ``uint8 [N, 3, H, W]`` and the text conditioning (the
        negative one only with CFG), each padded as :meth:`embed` pads. The seam another engine overrides
        (:class:`polyrl_diffusion.vllm_omni.VllmOmniRollout`); the plan, the noise and the batch fields stay
        :meth:`generate`'s."""
        cond = self.embed(batch.prompts)
        scale = batch.cfg_scale
        uncond = self.embed(batch.negatives) if scale > 1.0 else None
        embedded = batch.embedded_guidance

        def velocity(lat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return guided(lambda xx, ss, emb: self.model.velocity(xx, ss, emb, embedded), lat, sigma, cond, uncond,
                          scale, _concat, self._keep_norm)

        step_gen = torch.Generator(device=self.device).manual_seed(batch.seed)
        traj = sample_trajectory(velocity, batch.noise.to(self.device), batch.sigmas, batch.plan, batch.trained,
                                 generator=step_gen)
        return traj, self.model.decode(traj.x0.to(self.device)), cond, uncond

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
        """Release the accelerator memory between generations (a colocated run trains meanwhile): the transformer,
        text encoders and VAE move to the host, the text-embedding cache is dropped and the platform returns its
        allocator's cached memory (``Platform.empty_cache``). Every level does the same: the weights stay on the
        host, so :meth:`wake_up` needs no reload. On a CPU the modules are already on the host."""
        if self._asleep:
            return
        self.clear_text_cache()
        if self.device.type != "cpu":
            self.model.move_to("cpu")
        self._asleep = True
        if self.platform is not None:
            self.platform.empty_cache()

    def wake_up(self) -> None:
        """Take the memory back: the modules return to the compute device (their weights unchanged, so the
        images are bit-identical to those before :meth:`sleep`)."""
        if not self._asleep:
            return
        if self.device.type != "cpu":
            self.model.move_to(self.device)
        self._params = dict(self.model.transformer.named_parameters())
        self._asleep = False

    @property
    def asleep(self) -> bool:
        """Whether :meth:`sleep` released the memory (until :meth:`wake_up` or the next ``generate``)."""
        return self._asleep

    def shutdown(self) -> None:
        """Nothing runs outside this process."""
