"""Images in the data path: rows with images through the dataset, the processor, collation and dispatch, with
the real tiny Qwen2-VL / Qwen2.5-VL (built in code) and transformers' own processor and rotary positions."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from polyrl import batch as batch_ops
from polyrl.data import RLDataset
from polyrl.data.multimodal import (
    MROPE_POSITION_IDS,
    MULTI_MODAL_INPUTS,
    ImageInputs,
    add_multimodal_fields,
    attach_image_inputs,
    encode_image_prompt,
    image_messages,
    load_processor,
    mrope_position_ids,
    processor_token_ids,
)
from polyrl.errors import DataError


@pytest.fixture(scope="module")
def vlm_25_dir(tmp_path_factory):
    from polyrl.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm25") / "model", arch="qwen2_5_vl", seed=1)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(str(tiny_vlm_dir))


def _png(path: Path, size=(56, 84), colour=(200, 30, 30)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(content: str, images: list | None = None, truth: str = "red") -> dict:
    row = {"prompt": [{"role": "user", "content": content}], "data_source": "shapes",
           "reward_model": {"ground_truth": truth}}
    if images is not None:
        row["images"] = images
    return row


# ---------------------------------------------------------------------------- processor and token counts


def test_text_model_has_no_processor(tiny_model_dir):
    assert load_processor(str(tiny_model_dir)) is None


def test_dataset_prompt_ids_are_the_processors_ids(processor, tmp_path):
    """Two images in one row, a row without images, an image given as bytes: ``prompt_ids`` are exactly what the
    processor makes of the rendered prompt, and the image tokens are what the images' grids say."""
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", size=(112, 40), colour=(0, 0, 255))
    raw = io.BytesIO()
    Image.new("RGB", (70, 70), (0, 200, 0)).save(raw, format="PNG")
    rows = [_row("<image> and <image>: which is red?", ["a.png", str(b)]),  # a relative path: the file's folder
            _row("no image here, 2+2="),
            _row("what colour? <image>", [{"bytes": raw.getvalue(), "path": None}])]
    data = _write(tmp_path / "d.jsonl", rows[:2])
    ds = RLDataset([data], processor.tokenizer, max_prompt_length=256, processor=processor)
    assert len(ds) == 2 and ds.stats["images"] == 2
    assert ds[0]["images"] == [str(a.resolve()), str(b.resolve())]
    image_token = processor_token_ids(processor)["image_token_id"]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"},
                                      {"type": "text", "text": ": which is red?"}]}],
        add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[Image.open(a).convert("RGB"), Image.open(b).convert("RGB")],
                         return_tensors="pt")
    assert ds[0]["prompt_ids"] == expected["input_ids"][0].tolist()
    grids = expected["image_grid_thw"]
    assert ds[0]["prompt_ids"].count(image_token) == int((grids.prod(-1) // 4).sum()) == 6 + 4
    assert image_token not in ds[1]["prompt_ids"]
    ids, images, downscaled = encode_image_prompt(rows[2]["prompt"], rows[2]["images"], processor)
    assert ids.count(image_token) == 4 and downscaled == 0  # 70x70 -> 56x56: 16 patches, 4 tokens


def test_mrope_positions_equal_transformers(processor, tiny_vlm_dir, vlm_25_dir):
    """Left padding, two images of different shapes, a response after the prompt: the positions
    :func:`mrope_position_ids` computes equal the model's own ``get_rope_index`` (Qwen2-VL and Qwen2.5-VL)."""
    from transformers import AutoModelForImageTextToText

    for path in (tiny_vlm_dir, vlm_25_dir):
        proc = load_processor(str(path))
        model = AutoModelForImageTextToText.from_pretrained(path)
        images = [Image.new("RGB", (56, 84)), Image.new("RGB", (112, 40))]
        ids, _, _ = encode_image_prompt("a <image> b <image> c", images, proc)
        text = proc.apply_chat_template(image_messages("a <image> b <image> c", 2), add_generation_prompt=True,
                                        tokenize=False)
        enc = proc(text=[text], images=images, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids
        pad, response = 3, [50, 51, 52]
        full = torch.tensor([[0] * pad + ids + response])
        mask = torch.tensor([[0] * pad + [1] * (len(ids) + len(response))])
        types = torch.cat([torch.zeros(1, pad, dtype=torch.long), enc["mm_token_type_ids"],
                           torch.zeros(1, len(response), dtype=torch.long)], 1)
        ref, _ = model.model.get_rope_index(full, mm_token_type_ids=types, image_grid_thw=enc["image_grid_thw"],
                                            attention_mask=mask)
        mine = mrope_position_ids(full[0], mask[0], enc["image_grid_thw"], **processor_token_ids(proc))
        assert torch.equal(mine, ref[:, 0]), path.name
        assert not torch.equal(mine[0], mine[1])  # the images really have 2-D positions


def test_an_image_token_sampled_in_the_response_is_text(processor):
    tok = processor_token_ids(processor)
    ids, _, _ = encode_image_prompt("<image>?", [Image.new("RGB", (56, 56))], processor)
    grid = processor.image_processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")["image_grid_thw"]
    seq = torch.tensor(ids + [7, tok["image_token_id"], 9])
    pos = mrope_position_ids(seq, None, grid, **tok)
    assert pos[:, -3:].tolist() == [[pos[0, -4] + 1, pos[0, -4] + 2, pos[0, -4] + 3]] * 3
    with pytest.raises(ValueError, match="image tokens"):  # fewer image tokens than the grid needs
        mrope_position_ids(torch.tensor(ids[:3] + ids[5:]), None, grid, **tok)


# ---------------------------------------------------------------------------- once per step, through the batch


def test_images_are_processed_once_per_step_and_shared_by_samples(processor, tmp_path):
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", colour=(0, 0, 200))
    rows = [{"images": [str(a)]}, {"images": [str(a), str(b)]}, {"prompt": "text"}]
    samples = [r for r in rows for _ in range(4)]  # GRPO's n samples are the same row object
    cache = ImageInputs(processor)
    out = attach_image_inputs(samples, cache)
    assert cache.processed == 2  # two distinct images, twelve samples
    assert out[0]["multi_modal_data"] is out[3]["multi_modal_data"]
    assert out[0]["multi_modal_data"]["pixel_values"].shape[0] == 24  # 56x84: 4x6 patches
    assert out[4]["multi_modal_data"]["image_grid_thw"].shape == (2, 3)
    assert "multi_modal_data" not in out[8]
    assert cache.inputs([str(a)]) is out[0]["multi_modal_data"]


def test_image_rows_through_collate_and_dispatch(processor, tmp_path):
    """Rows with two images, one image and none: collated, then split over two data-parallel ranks, reordered
    (balancing) and concatenated again, each row keeps its own images and positions."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", size=(112, 56), colour=(0, 0, 200))
    specs = [[str(a), str(b)], [str(b)], None, [str(a)]]
    cache = ImageInputs(processor)
    inputs, outputs = [], []
    for k, images in enumerate(specs):
        if images:
            ids, _, _ = encode_image_prompt("x" + "<image>" * len(images), images, processor)
        else:
            ids = processor.tokenizer("plain text")["input_ids"]
        inputs.append(cache.inputs(images))
        outputs.append(AgentLoopOutput(prompt_ids=ids, response_ids=[40 + k, 41], response_mask=[1, 1]))
    batch = collate(outputs, pad_token_id=processor.tokenizer.pad_token_id, max_prompt_length=48, max_response_length=4)
    add_multimodal_fields(batch, inputs, **processor_token_ids(processor))
    assert batch[MROPE_POSITION_IDS].shape == (4, 3, 52)
    sent = batch_ops.engine_fields(batch)  # what the trainer dispatches to the engines
    assert MULTI_MODAL_INPUTS in sent.keys() and MROPE_POSITION_IDS in sent.keys()
    shards = batch_ops.split(sent[torch.tensor([3, 2, 1, 0])], 2)
    back = batch_ops.concat(shards)[torch.tensor([3, 2, 1, 0])]
    for i, images in enumerate(specs):
        row = batch_ops.non_tensor(back, MULTI_MODAL_INPUTS)[i]
        if images is None:
            assert row is None
            assert torch.equal(back[MROPE_POSITION_IDS][i, 0], back[MROPE_POSITION_IDS][i, 2])
            continue
        assert torch.equal(row["image_grid_thw"], inputs[i]["image_grid_thw"])
        assert torch.equal(row["pixel_values"], inputs[i]["pixel_values"])
        assert torch.equal(back[MROPE_POSITION_IDS][i], batch[MROPE_POSITION_IDS][i])
    assert batch_ops.non_tensor(back, MULTI_MODAL_INPUTS)[0]["image_grid_thw"].shape == (2, 3)


# ---------------------------------------------------------------------------- bad input


def test_missing_and_broken_images_name_the_row_or_are_skipped(processor, tmp_path, caplog):
    good = _png(tmp_path / "good.png")
    (tmp_path / "notes.png").write_text("this is not an image")
    rows = [_row("<image>?", [str(good)]), _row("<image>?", ["missing.png"]), _row("<image>?", ["notes.png"]),
            _row("<image> <image>?", [str(good)]), _row("<image>?", [str(good), str(good)]), _row("<image>?")]
    data = _write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError) as err:
        RLDataset([data], processor.tokenizer, max_prompt_length=128, processor=processor)
    assert f"{data} row 1: image 0 (" in str(err.value) and "missing.png" in str(err.value)
    assert "does not exist" in str(err.value) and "data.on_bad_row=skip" in str(err.value)
    with caplog.at_level(logging.WARNING):
        ds = RLDataset([data], processor.tokenizer, max_prompt_length=128, processor=processor, on_bad_row="skip")
    assert len(ds) == 1 and ds.stats["bad_rows"] == 5 and ds.stats["rows"] == 6
    text = caplog.text
    assert "row 2: image 0" in text and "not an image" in text
    assert "row 3: the prompt has 2 image placeholders" in text and "has 1 image" in text  # more placeholders
    assert "row 4: the prompt has 1 image placeholder" in text  # more images than placeholders
    assert "row 5: the prompt has 1 image placeholder" in text and "has 0 images" in text  # placeholder, no image


def test_a_text_only_model_given_image_rows_is_refused(tiny_tokenizer, tmp_path):
    data = _write(tmp_path / "rows.jsonl", [_row("2+2="), _row("<image>?", ["x.png"])])
    with pytest.raises(DataError, match=r"row 1 has images \('images'\) but the model is text-only"):
        RLDataset([data], tiny_tokenizer, max_prompt_length=64, on_bad_row="skip")


def test_images_over_the_limits(processor, tmp_path, monkeypatch):
    """Over PIL's decompression-bomb limit: a bad row. An aspect ratio the processor refuses: a bad row. Larger
    than the processor keeps: resized down by it (counted), never an error. A long prompt with images is never cut."""
    big = _png(tmp_path / "big.png", size=(400, 300))
    thin = _png(tmp_path / "thin.png", size=(2000, 9))
    data = _write(tmp_path / "rows.jsonl", [_row("<image>?", [str(big)]), _row("<image>?", [str(thin)])])
    ds = RLDataset([data], processor.tokenizer, max_prompt_length=128, processor=processor, on_bad_row="skip")
    assert len(ds) == 1 and ds.stats["images_downscaled"] == 1 and ds.stats["bad_rows"] == 1
    grid = processor.image_processor(images=[Image.open(big)], return_tensors="pt")["image_grid_thw"]
    tokens = ds[0]["prompt_ids"].count(processor_token_ids(processor)["image_token_id"])
    assert tokens == int(grid.prod()) // 4 <= 16  # at most 112 x 112 pixels: 16 tokens
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    with pytest.raises(DataError, match="larger than PIL's limit"):
        RLDataset([data], processor.tokenizer, max_prompt_length=128, processor=processor)
    monkeypatch.undo()
    long = _write(tmp_path / "long.jsonl", [_row("<image>" + "y" * 40, [str(big)])])
    ds = RLDataset([long], processor.tokenizer, max_prompt_length=40, processor=processor, truncation="left")
    assert len(ds) == 0 and ds.stats["filtered"] == 1
    with pytest.raises(DataError, match="tokens with its images"):
        RLDataset([long], processor.tokenizer, max_prompt_length=40, processor=processor, truncation="error")


def test_sft_rows_with_images(processor, tmp_path):
    from polyrl.trainer.sft import sft_batch, sft_examples

    a = _png(tmp_path / "a.png")
    rows = [dict(_row("<image>colour?", ["a.png"]), response="red"), {"prompt": "2+2=", "response": "4"}]
    data = _write(tmp_path / "sft.jsonl", rows)
    examples = sft_examples(rows, processor.tokenizer, "response", 64, 8, source=str(data), processor=processor)
    assert examples[0][2] == [str(a.resolve())] and examples[1][2] == []
    batch = sft_batch(examples, processor.tokenizer.pad_token_id, processor=processor)
    mm = batch_ops.non_tensor(batch, MULTI_MODAL_INPUTS)
    assert mm[0]["image_grid_thw"].tolist() == [[1, 6, 4]] and mm[1] is None
    with pytest.raises(DataError, match="row 0 has images"):
        sft_examples(rows, processor.tokenizer, "response", 64, 8, source=str(data))


def test_chat_template_kwargs_reach_image_rows(processor, tmp_path):
    """``data.apply_chat_template_kwargs`` renders image rows too (the processor's template), not only text rows."""
    from polyrl.models.tiny_vlm import VL_CHAT_TEMPLATE

    processor.chat_template = VL_CHAT_TEMPLATE.replace(
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        "{% if add_generation_prompt %}<|assistant|>{% if prefix %}{{ prefix }}{% endif %}{% endif %}")
    _png(tmp_path / "a.png")
    data = _write(tmp_path / "d.jsonl", [_row("what colour? <image>", ["a.png"])])
    plain = RLDataset([data], processor.tokenizer, max_prompt_length=256, processor=processor)[0]["prompt_ids"]
    ds = RLDataset([data], processor.tokenizer, max_prompt_length=256, processor=processor,
                   chat_template_kwargs={"prefix": "Answer:"})
    suffix = processor.tokenizer.encode("Answer:", add_special_tokens=False)
    assert ds[0]["prompt_ids"] == plain + suffix
