"""What runs inside vllm-omni's diffusion worker for the ``vllm_omni`` rollout (:mod:`polyrl_diffusion.vllm_omni`).

vllm-omni imports these classes by the qualified names the rollout gives it (``custom_pipeline_args`` and
``worker_extension_cls``); importing this module imports vllm-omni (GPU machines only: see
:mod:`polyrl_diffusion.vllm_omni`). Written against vllm-omni 0.30's public custom-pipeline API, not run in this
repository; ``tests/test_vllm_omni.py`` runs it where a GPU and vllm-omni are present.

:class:`PolyrlQwenImagePipeline` is vllm-omni's ``QwenImagePipeline`` (its transformer, text encoder, VAE, weight
loading and parallel layers) with ``forward`` replaced: each request of the batch carries a polyrl job in its
sampling params' ``extra_args`` and is integrated by :func:`polyrl_diffusion.vllm_omni.run_job` (polyrl's SDE
sampler, the same code as the ``diffusers`` rollout) around vllm-omni's modules; the result rides back in the
``DiffusionOutput``'s ``trajectory_latents``. :class:`PolyrlWorkerExtension` adds the weight-sync method that the
rollout calls through ``collective_rpc``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from polyrl_diffusion.models import TextEmbeddings, _pack, _unpack, decode_qwenimage, guidance_norm, to_uint8
from polyrl_diffusion.vllm_omni import JOB_KEY, job_of, run_job


class PolyrlQwenImagePipeline(QwenImagePipeline):
    """vllm-omni's QwenImage pipeline sampling with polyrl's SDE sampler: one output per request, each request
    a whole chunk of rows planned by the rollout."""

    def _polyrl_encode(self, prompts: list[str], max_length: int) -> TextEmbeddings:
        embeds, mask = self.encode_prompt(prompt=list(prompts), max_sequence_length=max_length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return TextEmbeddings(embeds.float(), embeds.new_zeros(embeds.shape[0], 0).float(), mask.long())

    def _polyrl_velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text: TextEmbeddings,
                         guidance: float) -> torch.Tensor:
        b, c, h, w = latents.shape
        dtype = next(self.transformer.parameters()).dtype
        mask = text.mask
        lengths = (mask.sum(-1).tolist() if mask is not None else [text.prompt_embeds.shape[1]] * b)
        embedded = (torch.full((b,), guidance, device=latents.device, dtype=dtype)
                    if getattr(self.transformer, "guidance_embeds", False) else None)
        out = self.transformer(hidden_states=_pack(latents.to(dtype)), timestep=sigma.to(dtype),
                               encoder_hidden_states=text.prompt_embeds.to(dtype), encoder_hidden_states_mask=mask,
                               img_shapes=[[(1, h // 2, w // 2)]] * b, txt_seq_lens=[int(n) for n in lengths],
                               guidance=embedded, return_dict=False)[0]
        return _unpack(out.float(), c, h, w)

    @torch.no_grad()
    def _polyrl_run(self, job: dict[str, Any]) -> dict[str, Any]:
        max_length = int(job["max_text_length"])
        return run_job(job, encode=lambda prompts: self._polyrl_encode(prompts, max_length),
                       velocity=self._polyrl_velocity,
                       decode=lambda x0: to_uint8(decode_qwenimage(self.vae, x0)),
                       keep_norm=guidance_norm("qwenimage"), device=self.device)

    def forward(self, req: Any) -> list[DiffusionOutput]:
        """One :class:`DiffusionOutput` per request of vllm-omni's request batch; a request without a polyrl job
        (vllm-omni's warm-up / dummy run) gets an empty output."""
        outputs = []
        for params in req.sampling_params_list:
            job = job_of(getattr(params, "extra_args", None))
            if job is None:
                outputs.append(DiffusionOutput(output=None))
                continue
            result = self._polyrl_run(job)
            images = result["images"].float() / 127.5 - 1.0  # vllm-omni's post-processing expects [-1, 1]
            outputs.append(DiffusionOutput(output=images, trajectory_latents={JOB_KEY: result}))
        return outputs


class PolyrlWorkerExtension:
    """Methods vllm-omni adds to its diffusion worker (``worker_extension_cls``), called by ``collective_rpc``."""

    model_runner: Any

    def polyrl_update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load transformer weights (diffusers names) with the pipeline's ``load_weights``; returns the names that
        loaded nothing (empty on success)."""
        pipeline = self.model_runner.pipeline
        device = next(pipeline.transformer.parameters()).device
        tensors = [(f"transformer.{name}", t.to(device)) for name, t in named_tensors]
        loaded = set(pipeline.load_weights(iter(tensors)))
        # the loader reports its own (possibly fused) parameter names: nothing loaded means nothing matched
        return [] if loaded else [name for name, _ in tensors]
