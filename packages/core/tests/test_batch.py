"""polyrl.batch: the batch container helpers and the data-parallel balancing order."""

from __future__ import annotations

import itertools

import pytest
import torch

from polyrl import batch as batch_ops


def _shard_loads(order, tokens, parts):
    step = len(order) // parts
    return [sum(tokens[i] for i in order[p * step : (p + 1) * step]) for p in range(parts)]


def test_balanced_order_keeps_groups_whole_and_evens_the_shards():
    # 4 groups of 2 rows; in the given order the first shard gets both long groups
    tokens = [90, 80, 70, 60, 10, 20, 15, 5]
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    order, imbalance = batch_ops.balanced_order(tokens, groups, 2)
    assert sorted(order) == list(range(8))
    for p in range(2):
        shard = order[p * 4 : (p + 1) * 4]
        assert all(groups.count(groups[i]) == sum(groups[j] == groups[i] for j in shard) for i in shard)
    naive = max(_shard_loads(list(range(8)), tokens, 2))
    balanced = _shard_loads(order, tokens, 2)
    assert max(balanced) < naive
    assert imbalance == pytest.approx(max(balanced) / (sum(tokens) / 2))


def test_balanced_order_finds_the_best_split_of_a_small_case():
    tokens = [7, 7, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1]  # group sums 14, 10, 8, 6, 4, 2
    groups = [i // 2 for i in range(12)]
    order, _ = batch_ops.balanced_order(tokens, groups, 2)
    sums = [14, 10, 8, 6, 4, 2]
    best = min(max(sum(c), sum(sums) - sum(c)) * 2 for c in itertools.combinations(sums, 3))
    assert max(_shard_loads(order, tokens, 2)) * 2 == best


@pytest.mark.parametrize(("groups", "parts"), [
    (["a", "a", "b", "c"], 2),           # groups of different sizes
    (["a", "a", "b", "b", "c", "c"], 2),  # 3 groups over 2 ranks
    (["a", "a", "b", "b"], 1),            # one rank
])
def test_balanced_order_leaves_what_it_cannot_balance(groups, parts):
    order, imbalance = batch_ops.balanced_order(list(range(len(groups))), groups, parts)
    assert order == list(range(len(groups))) and imbalance == 1.0


def test_reordering_a_batch_keeps_non_tensor_fields_aligned():
    b = batch_ops.make_batch({"x": torch.arange(4)}, {"uid": ["p", "q", "r", "s"]})
    reordered = b[torch.tensor([2, 0, 3, 1])]
    assert reordered["x"].tolist() == [2, 0, 3, 1]
    assert batch_ops.non_tensor(reordered, "uid") == ["r", "p", "s", "q"]
