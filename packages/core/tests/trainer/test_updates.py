"""The update epochs and the one definition of an on-policy update (``polyrl.trainer.updates``)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from polyrl.trainer.updates import mini_batch_rows, run_update_epochs, single_update_pass


class _RecordingEngine:
    """Records the rows of every ``train_batch`` call (the loop under test, not an engine)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def train_batch(self, batch, loss_fn, *, temperature=1.0):
        self.calls.append(batch["row"].tolist())
        return {"loss": float(len(self.calls)), "temperature": temperature}


def test_epochs_of_mini_batches_with_averaged_metrics():
    batch = TensorDict({"row": torch.arange(8)}, batch_size=[8])
    engine = _RecordingEngine()
    metrics = run_update_epochs(engine, batch, 4, 2, None, shuffle=False, seed=0, temperature=0.7)
    assert engine.calls == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert metrics == {"loss": 2.5, "temperature": 0.7}
    shuffled = _RecordingEngine()
    run_update_epochs(shuffled, batch, 4, 2, None, shuffle=True, seed=3)
    assert [sorted(r for c in shuffled.calls[i:i + 2] for r in c) for i in (0, 2)] == [list(range(8))] * 2
    assert shuffled.calls[:2] != shuffled.calls[2:]  # each epoch draws its own order
    again = _RecordingEngine()
    run_update_epochs(again, batch, 4, 2, None, shuffle=True, seed=3)
    assert again.calls == shuffled.calls  # seeded


def test_rows_per_rank_and_the_on_policy_case():
    assert mini_batch_rows(4, 8, 2) == 16
    assert single_update_pass(1, 8, 8) and single_update_pass(1, 16, 12)  # one step on the whole batch
    assert not single_update_pass(2, 8, 8) and not single_update_pass(1, 4, 8)
