"""``start_ray``: a local Ray on loopback without a dashboard, Ray's auth left alone; a cluster address joins it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from polyrl.trainer.role_groups import start_ray


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a developer's cluster address must not leak in
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    return calls


def _config(address: str = "", **trainer) -> SimpleNamespace:
    t = dict(ray_address=address, ray_num_cpus=2, n_workers=1, rollout_workers=1, placement="colocated")
    return SimpleNamespace(trainer=SimpleNamespace(**{**t, **trainer}), actor=SimpleNamespace(engine="fsdp"),
                           rollout=SimpleNamespace(name="hf"))


def test_local_ray_binds_loopback_and_keeps_auth(fake_ray, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert start_ray(_config(), tmp_path)
    (kw,) = fake_ray
    assert kw["_node_ip_address"] == "127.0.0.1" and kw["include_dashboard"] is False
    assert "RAY_AUTH_MODE" not in os.environ


def test_local_ray_sets_no_runtime_env(fake_ray, monkeypatch, tmp_path):
    """A local Ray's workers inherit the driver's environment (RAY_AUTH_MODE included); a runtime_env would make
    every actor wait for a worker process of its own instead of one Ray started ahead."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    start_ray(_config(), tmp_path)
    assert "runtime_env" not in fake_ray[0]


def test_cluster_workers_follow_the_drivers_auth_choice(fake_ray, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    start_ray(_config("10.0.0.5:6379"), tmp_path)
    assert fake_ray[0]["runtime_env"]["env_vars"]["RAY_AUTH_MODE"] == "disabled"


def test_cluster_address_joins_the_cluster(fake_ray, tmp_path):
    start_ray(_config("10.0.0.5:6379"), tmp_path)
    (kw,) = fake_ray
    assert kw["address"] == "10.0.0.5:6379" and "_node_ip_address" not in kw and "num_cpus" not in kw
    assert not (tmp_path / "ray").exists()


def test_ray_address_environment_variable_joins_the_cluster(fake_ray, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert start_ray(_config(), tmp_path)
    (kw,) = fake_ray
    assert kw["address"] == "10.0.0.7:6379" and "num_cpus" not in kw and "_temp_dir" not in kw


def test_config_address_wins_over_the_environment(fake_ray, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    start_ray(_config("10.0.0.5:6379"), tmp_path)
    assert fake_ray[0]["address"] == "10.0.0.5:6379"


@pytest.mark.parametrize(("trainer", "preloads"), [({"n_workers": 2, "ray_num_cpus": 2}, True),
                                                    ({"n_workers": 1, "ray_num_cpus": 2}, True),
                                                    ({"n_workers": 2, "ray_num_cpus": 16}, False)])
def test_workers_started_ahead_preload_what_actors_import_when_they_will_be_used(fake_ray, tmp_path, trainer,
                                                                                  preloads):
    """Ray starts ``num_cpus`` worker processes ahead; when about that many workers are started, they import
    torch, the worker and the configured engine and rollout while Ray finishes starting; with many spare
    processes (more cores than workers) nothing is preloaded."""
    start_ray(_config(**trainer), tmp_path)
    (kw,) = fake_ray
    assert kw["num_cpus"] == trainer["ray_num_cpus"]
    preload = kw["_system_config"].get("preload_python_modules", [])
    if preloads:
        assert {"torch", "tensordict", "polyrl.trainer.role_worker", "polyrl.rollout.hf"} <= set(preload)
    else:
        assert preload == []
