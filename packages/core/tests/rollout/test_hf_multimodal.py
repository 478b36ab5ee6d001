"""The hf rollout generating from images (tiny Qwen2-VL built in code): its log-probs are the model's own on the
same images, each prompt sees its own images, and text and image requests mix in one call."""

from __future__ import annotations

import types

import pytest
import torch
from PIL import Image

from polyrl.data.multimodal import (
    ImageInputs,
    encode_image_prompt,
    load_processor,
    mrope_position_ids,
    processor_token_ids,
)
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl.rollout.hf import HFRollout


@pytest.fixture(scope="module")
def rollout_and_processor(tiny_vlm_dir):
    processor = load_processor(str(tiny_vlm_dir))
    config = types.SimpleNamespace(max_model_len=0, max_batch_size=64, dtype="float32")
    return HFRollout(config, model_path=str(tiny_vlm_dir), tokenizer=processor.tokenizer), processor


def _reference_log_probs(model, processor, result, images) -> list[float]:
    """Teacher-forced log-probs of the sampled tokens: one forward of prompt + response through the model's own
    image path (``pixel_values`` merged by transformers), positions from the image grids."""
    full = torch.tensor([result.prompt_ids + result.response_ids])
    pos = mrope_position_ids(full[0], None, images["image_grid_thw"], **processor_token_ids(processor))[:, None]
    with torch.no_grad():
        logits = model(input_ids=full, position_ids=pos, pixel_values=images["pixel_values"],
                       image_grid_thw=images["image_grid_thw"]).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    p = len(result.prompt_ids)
    return [float(logp[p - 1 + t, tok]) for t, tok in enumerate(result.response_ids)]


def test_log_probs_are_the_models_on_its_own_images(rollout_and_processor):
    """Two prompts with the same text and different images, three samples each, plus a text prompt: every
    sample's log-probs equal a teacher-forced pass over *its* image (a prefill shared across the two images
    would fail this), and the text prompt runs beside them."""
    rollout, processor = rollout_and_processor
    cache = ImageInputs(processor)
    pictures = [Image.new("RGB", (56, 56), (250, 0, 0)), Image.new("RGB", (56, 56), (0, 0, 250))]
    params = SamplingParams(max_new_tokens=6, n=3, seed=5, temperature=1.0, ignore_eos=True)
    requests = []
    for picture in pictures:
        ids, _, _ = encode_image_prompt("Which colour? <image>", [picture], processor)
        requests.append(GenerationRequest(prompt_ids=ids, sampling_params=params, multi_modal=cache.inputs([picture])))
    assert requests[0].prompt_ids == requests[1].prompt_ids
    requests.append(GenerationRequest(prompt_ids=processor.tokenizer("plain")["input_ids"], sampling_params=params))
    results = rollout.generate(requests)
    assert len(results) == 9 and [r.sample_index for r in results] == [0, 1, 2] * 3
    for k, result in enumerate(results[:6]):
        images = requests[k // 3].multi_modal
        ref = _reference_log_probs(rollout.model, processor, result, images)
        assert result.log_probs == pytest.approx(ref, abs=1e-5)
        other = requests[1 - k // 3].multi_modal  # the other image gives other log-probs: the image is used
        assert max(abs(a - b) for a, b in zip(result.log_probs,
                                               _reference_log_probs(rollout.model, processor, result, other))) > 1e-4
    assert all(len(r.response_ids) == 6 for r in results)


def test_update_weights_reaches_the_vision_tower(rollout_and_processor):
    rollout, processor = rollout_and_processor
    name = next(n for n, _ in rollout.model.named_parameters() if "visual" in n)
    old = dict(rollout.model.named_parameters())[name].detach().clone()
    try:
        rollout.update_weights([(name, old + 1.0)])
        assert torch.equal(dict(rollout.model.named_parameters())[name], old + 1.0)
    finally:
        rollout.update_weights([(name, old)])
