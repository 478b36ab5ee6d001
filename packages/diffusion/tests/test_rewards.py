"""Offline image rewards: JPEG (in)compressibility, brightness, colourfulness, OCR on PIL-rendered text,
weighted combinations, a user's reward model, and the image reward manager on a batch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from polyrl_diffusion.rewards import (
    CallableReward,
    ImageRewardManager,
    RewardError,
    WeightedReward,
    as_uint8_images,
    brightness,
    build_image_reward,
    call_reward,
    colourfulness,
    edit_distance,
    jpeg_compressibility,
    jpeg_incompressibility,
    ocr_text_score,
    quoted_text,
)

from polyrl.batch import make_batch


def flat_and_noisy(size: int = 32) -> np.ndarray:
    rng = np.random.default_rng(0)
    flat = np.full((size, size, 3), 128, dtype=np.uint8)
    noisy = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    return np.stack([flat, noisy])


def render(text: str, size: tuple[int, int] = (192, 64)) -> np.ndarray:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((12, 14), text, fill="black", font=ImageFont.load_default(size=32))
    return np.asarray(img)


def test_image_formats():
    imgs = flat_and_noisy(8)
    chw = torch.from_numpy(imgs).permute(0, 3, 1, 2)
    assert np.array_equal(as_uint8_images(chw), imgs)
    assert np.array_equal(as_uint8_images(chw.float() / 255), imgs)
    assert np.array_equal(as_uint8_images([Image.fromarray(i) for i in imgs]), imgs)
    assert as_uint8_images(imgs[0]).shape == (1, 8, 8, 3)
    with pytest.raises(ValueError, match="channels"):
        as_uint8_images(np.zeros((2, 8, 8, 5)))
    with pytest.raises(ValueError, match="NaN"):
        as_uint8_images(torch.full((1, 3, 4, 4), float("nan")))


def test_jpeg_sign_compressible_images_score_higher():
    imgs = flat_and_noisy()
    comp, incomp = jpeg_compressibility(imgs), jpeg_incompressibility(imgs)
    assert float(comp[0]) > float(comp[1]), "compressibility: the flat image (small JPEG) must score higher"
    assert float(incomp[1]) > float(incomp[0]), "incompressibility: the noisy image must score higher"
    buf = io.BytesIO()
    Image.fromarray(imgs[1]).save(buf, format="JPEG", quality=95)
    assert float(comp[1]) == pytest.approx(-buf.tell() / 1000.0)
    assert torch.allclose(comp, -incomp)


def test_brightness_and_colourfulness():
    black, white = np.zeros((4, 4, 3), np.uint8), np.full((4, 4, 3), 255, np.uint8)
    gray = np.full((4, 4, 3), 90, np.uint8)
    red = np.zeros((4, 4, 3), np.uint8)
    red[..., 0] = 255
    assert brightness(np.stack([black, white])).tolist() == [0.0, 1.0]
    col = colourfulness(np.stack([gray, red]))
    assert float(col[0]) == 0.0 and float(col[1]) > 0.8


def test_ocr_text_score_and_helpers():
    assert edit_distance("kitten", "sitting") == 3
    assert quoted_text('an image with the text "Hello World"') == "Hello World"
    assert quoted_text("a sign saying 'open'") == "open"
    assert ocr_text_score("Hello World", "hello world") == 1.0
    assert ocr_text_score("xx hello world yy", "helloworld") == 1.0  # contained
    assert ocr_text_score("hellp", "hello") == pytest.approx(0.8)
    assert ocr_text_score("", "hello") == 0.0
    assert ocr_text_score("completely different and long", "abc") == 0.0  # distance capped at the length


def test_ocr_reward_reads_pil_rendered_text():
    pytest.importorskip("rapidocr")
    from polyrl_diffusion.rewards import ocr

    images = np.stack([render("polyrl"), render("banana"), render("banana")])
    prompts = ['an image with the text "polyrl"'] * 3
    out = ocr(images, prompts, ground_truths=[None, None, "banana"])  # the ground truth wins over the quotes
    right, wrong, truth = out["score"]
    assert right > 0.9 and truth > 0.9, out
    assert wrong < 0.5, out


def test_weighted_reward_and_spec_strings():
    imgs = flat_and_noisy()
    combo = build_image_reward({"brightness": 2.0, "jpeg_compressibility": 0.5}) if _registered() else \
        WeightedReward([(brightness, 2.0), (jpeg_compressibility, 0.5)])
    scores, extra = call_reward(combo, imgs, ["a", "b"])
    expected = 2.0 * brightness(imgs) + 0.5 * jpeg_compressibility(imgs)
    assert torch.allclose(scores, expected, atol=1e-5)
    assert len(extra) == 2 and all(len(v) == 2 for v in extra.values())
    imported = build_image_reward("polyrl_diffusion.rewards:brightness")
    assert imported is brightness
    with pytest.raises(ValueError, match="not a number"):
        build_image_reward("brightness=heavy")


def _registered() -> bool:
    from polyrl.plugins import get_plugin_manager

    return "brightness" in get_plugin_manager().registry("reward_function")


def test_user_reward_model_callable():
    def redness(images, prompts):  # a user's model: float [B, 3, H, W] in, one score per image out
        return images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))

    red = np.zeros((2, 4, 4, 3), np.uint8)
    red[0, ..., 0] = 255
    reward = CallableReward(redness, image_format="float", name="redness")
    scores, _ = call_reward(reward, red, ["x", "y"])
    assert scores.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("bad, match", [
    (lambda images, prompts: [float("nan")] * len(prompts), "NaN"),
    (lambda images, prompts: [1.0], r"shape \(1,\)"),
    (lambda images, prompts: torch.zeros(len(prompts), 3), "one number per image"),
])
def test_bad_reward_output_raises_naming_the_reward(bad, match):
    reward = CallableReward(bad, name="my_aesthetic_model")
    with pytest.raises(RewardError, match="my_aesthetic_model") as info:
        call_reward(reward, flat_and_noisy(), ["a", "b"])
    assert info.match(match)


def test_dict_reward_without_score_raises_naming_it():
    def my_scorer(images, prompts):
        return {"value": [1.0, 2.0]}

    with pytest.raises(RewardError, match="my_scorer.*without 'score'"):
        call_reward(my_scorer, flat_and_noisy(), ["a", "b"])


def test_image_reward_manager_on_a_batch():
    imgs = torch.from_numpy(np.stack([np.zeros((4, 4, 3), np.uint8), np.full((4, 4, 3), 255, np.uint8)]))
    batch = make_batch({"images": imgs.permute(0, 3, 1, 2).contiguous(), "response_mask": torch.ones(2, 3)},
                       {"prompt": ["dark", "light"], "data_source": ["brightness"] * 2,
                        "ground_truth": [None, None], "extra_info": [{}, {}]})
    out = ImageRewardManager(compute_score=brightness)(batch)
    assert out.token_level_scores.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert out.extra["score"] == [0.0, 1.0]
    nan = ImageRewardManager(compute_score=lambda images, prompts: [float("nan")] * 2)
    with pytest.raises(RewardError, match="lambda"):
        nan(batch)
    no_images = make_batch({"response_mask": torch.ones(2, 3)}, {"prompt": ["a", "b"]})
    with pytest.raises(KeyError, match="images"):
        ImageRewardManager(compute_score=brightness)(no_images)


def test_image_reward_manager_picks_reward_by_data_source():
    if not _registered():
        pytest.skip("the diffusion plugin's reward functions are not registered in this environment")
    from polyrl.rewards.scoring import default_compute_score

    manager = ImageRewardManager(compute_score=default_compute_score)
    imgs = flat_and_noisy()
    scores, _ = manager.score(imgs, ["a", "b"], data_sources=["brightness", "jpeg_compressibility"])
    assert float(scores[0]) == pytest.approx(float(brightness(imgs[:1])[0]))
    assert float(scores[1]) == pytest.approx(float(jpeg_compressibility(imgs[1:])[0]))
    with pytest.raises(KeyError, match="no image reward registered for data_source 'gsm8k'"):
        manager.score(imgs, ["a", "b"], data_sources=["gsm8k", "gsm8k"])


def test_rapidocr_warnings_go_to_the_run_log_not_the_console(tmp_path, capfd):
    """Issue 47: RapidOCR's "The text detection result is empty" (one per image without text) filled the console."""
    import logging

    from polyrl_diffusion.rewards import OcrReward

    from polyrl.logs import setup_run_logging

    log_file = setup_run_logging(tmp_path)
    try:
        out = OcrReward()(np.zeros((2, 48, 48, 3), dtype=np.uint8), ['a sign "open"', 'a sign "shut"'])
        assert out["score"] == [0.0, 0.0]
        captured = capfd.readouterr()
        assert "RapidOCR" not in captured.err + captured.out and "detection result is empty" not in captured.err
        for handler in logging.getLogger("polyrl").handlers:
            handler.flush()
        assert "The text detection result is empty" in log_file.read_text()
    finally:
        for handler in list(logging.getLogger("polyrl").handlers):
            if getattr(handler, "baseFilename", None) == str(log_file):
                logging.getLogger("polyrl").removeHandler(handler)
                handler.close()
