"""The SGLang rollout with a vision-language model on the real SGLang engine (marker ``gpu``).

Skipped without SGLang and a CUDA GPU (SGLang has no CPU build): written on a CPU machine, not run yet. On a
GPU machine: ``pytest packages/rollout-sglang/tests -m gpu``; record the result in docs/vlm.md.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang", reason="SGLang is not installed (CUDA only): pip install 'polyrl-rollout-sglang[cuda]'")
if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("SGLang needs a CUDA GPU", allow_module_level=True)

from PIL import Image  # noqa: E402

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.data.multimodal import (  # noqa: E402
    ImageInputs,
    encode_image_prompt,
    load_processor,
    mrope_position_ids,
    processor_token_ids,
)
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_sglang.config import SGLangConfig  # noqa: E402
from polyrl_rollout_sglang.rollout import SGLangRollout  # noqa: E402

CFG = RolloutConfig(name="sglang", prompt_length=64, response_length=16, gpu_memory_utilization=0.3,
                    plugin_config=SGLangConfig(disable_cuda_graph=True))


def test_image_rows_log_probs_match_transformers(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    processor = load_processor(str(tiny_vlm_dir))
    rollout = SGLangRollout(CFG, model_path=str(tiny_vlm_dir), tokenizer=processor.tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    picture = Image.new("RGB", (84, 56), (0, 0, 250))
    ids, _, _ = encode_image_prompt("Colour? <image>", [picture], processor)
    images = ImageInputs(processor).inputs([picture])
    request = GenerationRequest(prompt_ids=ids, multi_modal=images,
                                sampling_params=SamplingParams(max_new_tokens=6, n=2, seed=1, ignore_eos=True))
    try:
        for result in rollout.generate([request]):
            full = torch.tensor([result.prompt_ids + result.response_ids])
            pos = mrope_position_ids(full[0], None, images["image_grid_thw"], **processor_token_ids(processor))
            with torch.no_grad():
                logits = model(input_ids=full, position_ids=pos[:, None], pixel_values=images["pixel_values"],
                               image_grid_thw=images["image_grid_thw"]).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            ref = [float(logp[len(ids) - 1 + t, tok]) for t, tok in enumerate(result.response_ids)]
            assert result.log_probs == pytest.approx(ref, abs=1e-3)
    finally:
        rollout.shutdown()
