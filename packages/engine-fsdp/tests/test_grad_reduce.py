"""GradReducer (the replicated layout's gradient all-reduce, overlapped with backward) on 2 real gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import run_ranks  # noqa: E402


@pytest.mark.parametrize("mode", ["all-used", "skip-last", "skip-all"])
def test_overlapped_buckets_average_every_ranks_gradients(tmp_path, mode):
    """Buckets launched from the gradient hooks during backward give each parameter the average of the ranks'
    accumulated gradients (two micro-batches), also when one rank leaves a layer out of its last backward (its
    buckets are never ready there: every rank must still pair the same buckets) or out of every one (a ``None``
    gradient counts as zeros)."""
    out = tmp_path / "result.pt"
    found = run_ranks("reducer_worker.py", 2, [str(out), mode], out)
    assert found["buckets"] == 6
    assert found["launched_in_backward"] >= 2  # the last layer's buckets start before backward ends
    for reduced, expected in zip(found["reduced"], found["expected"]):
        assert torch.allclose(reduced, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(found["reduced"][2], torch.zeros_like(found["reduced"][2]))  # the middle layer's weight
