"""Every validation of a flow_grpo run keeps its images: ``<step>.png`` (a grid with each prompt and reward) and
``<step>.jsonl`` under ``trainer.validation_data_dir``. A one-step run of the tiny SD3-family pipeline,
``executor=local``."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from polyrl_diffusion.quickstart import flow_grpo_overrides
from polyrl_diffusion.trainer import write_captioned_grid

from polyrl.trainer.commands import train
from polyrl.trainer.generations import read_jsonl


def test_captioned_grid_places_each_image_over_its_caption(tmp_path):
    images = torch.stack([torch.full((3, 16, 16), v, dtype=torch.uint8) for v in (0, 80, 160)])
    path = write_captioned_grid(images, ["0.100 a cat", "0.200 a dog", "0.300 a house"], tmp_path / "g.png",
                                columns=2, caption_height=24)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 * (16 + 24), 2 * 16, 3)
    assert (grid[:16, :16] == 0).all() and (grid[:16, 16:32] == 80).all() and (grid[40:56, :16] == 160).all()
    caption = grid[16:40, :16]
    assert (caption < 128).any() and (caption == 255).any()  # dark text on the white strip
    assert (grid[40:, 16:] == 255).all()  # the empty cell stays blank


def test_validation_writes_png_grid_and_jsonl(tmp_path, caplog):
    from polyrl_diffusion.models import make_tiny_pipeline

    model = make_tiny_pipeline(tmp_path / "model", family="sd3", seed=0)
    prompts = ["a red house", "a dark sky", "a tree"]
    rows = [{"prompt": p, "data_source": "images"} for p in prompts]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 2))
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="polyrl"):
        train(manifest, [], [*flow_grpo_overrides(model, tmp_path / "train.jsonl", run, batch=2, n=2, lr=1e-3,
                                                  steps=1, sampler_steps=2),
                             f"data.val_files=[{tmp_path / 'val.jsonl'}]", "trainer.flow_grpo.eval_steps=2",
                             "trainer.logger=[jsonl,console]"])
    val_dir = run / "generations" / "validation"
    got = read_jsonl(val_dir / "0.jsonl")
    assert [r["prompt"] for r in got] == prompts and all(isinstance(r["score"], float) for r in got)
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert np.mean([r["score"] for r in got]) == pytest.approx(metrics["val/images/mean@1"])
    # issue 47: a diffusion run's validation score reaches the console's step line and the end-of-run summary
    step_lines = [r.getMessage() for r in caplog.records if r.name == "polyrl.metrics"]
    assert any("val/images/mean@1=" in line for line in step_lines), step_lines
    assert any("best val/images/mean@1" in r.getMessage() for r in caplog.records), caplog.text
    grid = np.asarray(Image.open(val_dir / "0.png"))
    assert grid.shape[1] % 3 == 0 and grid.shape[0] - 24 == grid.shape[1] // 3  # three square images, one row
