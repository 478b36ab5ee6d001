"""``trainer.placement``: shorthands and role -> pool mappings resolved, and every bad spelling refused in one
line before any process starts."""

from __future__ import annotations

import pytest

from polyrl.config.schema import PolyrlConfig
from polyrl.errors import ConfigError
from polyrl.trainer.placement import Placement, Pool, check_pools_fit, resolve_placement
from polyrl.trainer.roles import RoleSpec, role_specs_by_name

ROLES = ["actor", "rollout", "ref", "critic", "reward_model"]


def _config(placement, pools=None, n_workers=2, rollout_workers=1, executor="ray") -> PolyrlConfig:
    cfg = PolyrlConfig()
    cfg.trainer.placement = placement
    cfg.trainer.pools = dict(pools or {})
    cfg.trainer.n_workers = n_workers
    cfg.trainer.rollout_workers = rollout_workers
    cfg.trainer.executor = executor
    return cfg


def test_colocated_is_one_pool_of_n_workers():
    p = resolve_placement(_config("colocated"), ROLES)
    assert p.pools == (Pool("colocated", 2, tuple(ROLES)),)
    assert p.shares("actor", "rollout") and p.total_workers == 2


def test_split_puts_the_rollout_alone_and_every_other_role_with_the_actor():
    p = resolve_placement(_config("split", rollout_workers=3), ROLES)
    assert p.pool_of("rollout") == Pool("rollout", 3, ("rollout",))
    assert p.pool_of("reward_model").name == "actor" and p.size_of("critic") == 2
    assert not p.shares("actor", "rollout") and p.total_workers == 5


def test_a_mapping_places_each_role_and_sizes_each_pool():
    cfg = _config({"actor": "a", "rollout": "b", "critic": "c", "reward_model": "c"}, {"c": 3})
    p = resolve_placement(cfg, ROLES)
    assert {pool.name: (pool.size, pool.roles) for pool in p.pools} == {
        "a": (2, ("actor", "ref")),  # ref is not named: the actor's pool
        "b": (1, ("rollout",)),  # the rollout's pool defaults to trainer.rollout_workers
        "c": (3, ("critic", "reward_model")),
    }
    assert p.describe() == "a (2): actor, ref; b (1): rollout; c (3): critic, reward_model"


def test_a_mapping_may_name_roles_the_run_does_not_use():
    cfg = _config({"actor": "a", "rollout": "a", "critic": "c"}, {"c": 1})
    p = resolve_placement(cfg, ["actor", "rollout"], known_roles=ROLES)
    assert [pool.name for pool in p.pools] == ["a"]


def test_the_local_executor_has_one_pool_of_one_rank():
    p = resolve_placement(_config({"actor": "a", "rollout": "b"}, executor="local"), ROLES)
    assert p.pools == (Pool("local", 1, tuple(ROLES)),)


@pytest.mark.parametrize(("placement", "pools", "message"), [
    ("hybrid", {}, r"trainer.placement='hybrid': choose 'colocated', 'split', or a mapping"),
    ("split", {"x": 1}, r"trainer.pools=\{'x': 1\} is set but trainer.placement='split' names no pools"),
    ({"rollout": "b"}, {}, r"has no pool for the actor: add actor: <pool>"),
    ({"actor": "a", "rolout": "b"}, {}, r"trainer.placement.rolout: no such role; roles: actor, critic, ref"),
    ({"actor": "a", "rollout": "b", "critic": "c"}, {}, r"trainer.pools has no size for pool 'c' \(holding critic\): "
                                                        r"add trainer.pools.c=N"),
    ({"actor": "a", "rollout": "b"}, {"a": 3}, r"trainer.pools.a=3 but trainer.n_workers=2"),
    ({"actor": "a", "rollout": "b"}, {"b": 0}, r"trainer.pools.b=0: a pool needs a whole number of workers"),
    ({"actor": "a", "rollout": "b"}, {"bb": 1}, r"trainer.pools.bb: no role is placed in pool 'bb'"),
    ({"actor": "a", "rollout": 3}, {}, r"trainer.placement.rollout=3: give the name of a pool"),
])
def test_bad_placements_are_one_line_config_errors(placement, pools, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve_placement(_config(placement, pools), ["actor", "rollout", "critic"], known_roles=ROLES)
    assert "\n" not in str(err.value)


def test_pools_that_do_not_fit_the_cluster_name_every_pool_and_the_resources():
    placement = Placement((Pool("train", 2, ("actor", "ref")), Pool("gen", 1, ("rollout",)),
                           Pool("rm", 2, ("reward_model",))), "mapping")
    check_pools_fit(placement, {"CPU": 8.0, "GPU": 5.0}, "GPU")  # fits
    with pytest.raises(ConfigError) as err:
        check_pools_fit(placement, {"CPU": 8.0, "GPU": 4.0}, "GPU")
    msg = str(err.value)
    assert "\n" not in msg
    assert "train (2 x actor+ref), gen (1 x rollout), rm (2 x reward_model) need 5 CPU, 5 GPU" in msg
    assert "the cluster has 8 CPU, 4 GPU" in msg
    with pytest.raises(ConfigError, match=r"need 5 CPU \(one of each per worker\); the cluster has 2 CPU"):
        check_pools_fit(placement, {"CPU": 2.0}, None)


def test_role_specs_refuse_builtin_names_duplicates_and_trained_inference_roles():
    with pytest.raises(ValueError, match="role 'critic' is built in"):
        RoleSpec("critic", "critic")
    with pytest.raises(ValueError, match="builds='tool'"):
        RoleSpec("judge", "judge", builds="tool")
    with pytest.raises(ValueError, match="a trained role builds an engine"):
        RoleSpec("teacher", "teacher", trains=True)
    spec = RoleSpec("teacher", "trainer.plugin_config.teacher")
    with pytest.raises(ValueError, match="role 'teacher' is declared twice"):
        role_specs_by_name([spec, spec])
    block = object()
    cfg = PolyrlConfig()
    cfg.trainer.plugin_config = {"teacher": block}
    assert spec.block(cfg) is block
