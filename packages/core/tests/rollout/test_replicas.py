"""Rollout replica planning and the per-replica split of prompts (pure functions)."""

from __future__ import annotations

import pytest

from polyrl.errors import ConfigError
from polyrl.rollout.replicas import Replica, leaders, plan_replicas, replica_call_args, replica_of


def test_tp1_is_one_replica_per_rank():
    replicas = plan_replicas(3, 1)
    assert [r.ranks for r in replicas] == [(0,), (1,), (2,)]
    assert leaders(replicas) == [0, 1, 2]


def test_replicas_take_consecutive_ranks_on_one_node():
    nodes = ["a", "a", "a", "a", "b", "b", "b", "b"]
    replicas = plan_replicas(8, 2, nodes)
    assert [r.ranks for r in replicas] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [r.node for r in replicas] == ["a", "a", "b", "b"]
    assert leaders(replicas) == [0, 2, 4, 6]
    assert replica_of(5, replicas).index == 2 and replicas[2].tp == 2


def test_tp_that_does_not_divide_the_devices_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 does not divide the 4 rollout devices"):
        plan_replicas(4, 3)
    with pytest.raises(ConfigError, match="at least one device"):
        plan_replicas(4, 0)


def test_replica_spanning_two_nodes_is_refused():
    # 3 devices on node a, 3 on b: with tp=2 the second replica would take a's last and b's first device
    with pytest.raises(ConfigError, match=r"replica 1 \(worker ranks 2-3\) cannot be placed on one node.*"
                                          r"\['a', 'b'\].*multiple of 2"):
        plan_replicas(6, 2, ["a", "a", "a", "b", "b", "b"])


def test_node_list_must_match_the_devices():
    with pytest.raises(ValueError, match="2 node ids for 4 devices"):
        plan_replicas(4, 2, ["a", "a"])


def test_each_leader_gets_its_share_and_the_other_ranks_nothing():
    replicas = [Replica(0, (0, 1)), Replica(1, (2, 3))]
    args = replica_call_args(list("abcdef"), replicas, 4)
    assert args == [(list("abc"),), ([],), (list("def"),), ([],)]
    with pytest.raises(ValueError, match="5 samples do not split evenly over 2 rollout replicas"):
        replica_call_args(list("abcde"), replicas, 4)
