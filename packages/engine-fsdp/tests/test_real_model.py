"""The FSDP engine on the real pretrained SmolLM2-135M-Instruct (polyrl.testing's ``real_model_dir``), on 1 and 2
gloo ranks: log-probs of chat-templated answers equal a plain transformers forward's, one training step runs and
moves them, and the two world sizes take the same step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import run_ranks  # noqa: E402
from real_worker import real_batch  # noqa: E402


@pytest.mark.timeout(300)  # about 45 s on 2 quiet cores
def test_one_and_two_ranks_on_the_real_model(real_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    one = run_ranks("real_worker.py", 1, [str(real_model_dir), str(tmp_path)], tmp_path / "real_1.pt")
    two = run_ranks("real_worker.py", 2, [str(real_model_dir), str(tmp_path)], tmp_path / "real_2.pt")
    b = real_batch(str(real_model_dir))
    model = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    for row in range(4):
        ids = b["input_ids"][row][b["attention_mask"][row].bool()][None]
        n = int(b["response_mask"][row].sum())
        with torch.no_grad():
            logits = model(ids).logits[0, -n - 1 : -1]
        hf = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None])[:, 0]
        for result in (one, two):
            assert torch.allclose(result["before"][row, :n], hf, atol=1e-4), row
    assert torch.isfinite(torch.tensor(one["grad_norm"])) and one["grad_norm"] > 0
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)  # float32 sums over 30 layers, 2 orders
    mask = b["response_mask"].bool()
    moved = (one["after"] - one["before"])[mask]
    assert moved.abs().max() > 1e-4  # the step changed the model
    # rows with advantage +1 became more likely on average, rows with -1 less
    up = (one["after"] - one["before"])[[0, 2]][mask[[0, 2]]].mean()
    down = (one["after"] - one["before"])[[1, 3]][mask[[1, 3]]].mean()
    assert up > 0 > down
    assert torch.allclose(one["after"][mask], two["after"][mask], atol=1e-4)
