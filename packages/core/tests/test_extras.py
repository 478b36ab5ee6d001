"""The core's optional extras: ``polyrl[ray]``, ``polyrl[math]``, ``polyrl[tools]``. Without one, what needs it
stops at start-up with one line naming the install line; ``trainer.executor=auto`` takes the local executor
unless the run needs more than one process.

A missing module is made so with ``sys.modules[name] = None`` (what Python does for a module that is not
installed: ``import`` fails, ``importlib.util.find_spec`` answers None); in ``make test-packages`` they are
really absent.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.executor import RAY_INSTALL, ray_installed, resolve_executor

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)


def _config(**trainer) -> SimpleNamespace:
    base = dict(executor="auto", n_workers=1, placement="colocated", async_mode="sync", ray_address="")
    return SimpleNamespace(trainer=SimpleNamespace(**{**base, **trainer}))


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray_installed()


@pytest.fixture
def with_ray(monkeypatch):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here (polyrl[ray])")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_auto_runs_one_worker_in_this_process_even_with_ray(with_ray):
    cfg = _config()
    assert resolve_executor(cfg) == "local" and cfg.trainer.executor == "local"


@pytest.mark.parametrize("setting", [{"n_workers": 2}, {"placement": "split"}, {"async_mode": "fully_async"},
                                     {"ray_address": "10.0.0.5:6379"}])
def test_auto_takes_ray_for_what_needs_several_processes(with_ray, setting):
    assert resolve_executor(_config(**setting)) == "ray"


def test_auto_without_ray_and_one_worker_is_local(no_ray):
    assert resolve_executor(_config()) == "local"


@pytest.mark.parametrize(("setting", "named"), [
    ({"n_workers": 2}, "trainer.n_workers=2"),
    ({"placement": "split"}, "trainer.placement=split"),
    ({"executor": "ray"}, "trainer.executor=ray"),
    ({"executor": "ray", "n_workers": 4}, "trainer.n_workers=4"),
])
def test_asking_for_ray_workers_without_ray_is_one_line_with_the_install_line(no_ray, setting, named):
    with pytest.raises(ConfigError) as err:
        resolve_executor(_config(**setting))
    message = str(err.value)
    assert named in message and RAY_INSTALL in message and "\n" not in message


def test_the_ray_address_variable_counts_as_asking_for_ray(no_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    with pytest.raises(ConfigError, match=r"RAY_ADDRESS=10\.0\.0\.7:6379.*polyrl\[ray\]"):
        resolve_executor(_config())


def test_an_unknown_executor_names_the_choices():
    with pytest.raises(ConfigError, match="trainer.executor.*'rey'.*auto, ray, local"):
        resolve_executor(_config(executor="rey"))


def test_local_stays_local_whatever_ray_does():
    assert resolve_executor(_config(executor="local", n_workers=2)) == "local"


def test_math_data_without_math_verify_stops_with_the_install_line(polyrl_plugin_manager, monkeypatch):
    from polyrl.rewards.scoring import check_reward_requirements

    monkeypatch.setitem(sys.modules, "math_verify", None)
    check_reward_requirements("", {"openai/gsm8k", "arithmetic"}, polyrl_plugin_manager)  # no MATH scorer: fine
    with pytest.raises(ConfigError) as err:
        check_reward_requirements("", {"openai/gsm8k", "lighteval/MATH"}, polyrl_plugin_manager)
    assert "'lighteval/MATH'" in str(err.value) and "pip install 'polyrl[math]'" in str(err.value)
    with pytest.raises(ConfigError, match=r"reward.function=geo3k.*polyrl\[math\]"):
        check_reward_requirements("geo3k", (), polyrl_plugin_manager)


def test_the_math_verifier_without_math_verify_names_the_extra(monkeypatch):
    from polyrl.rewards.math_verifier import MathVerifier

    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'polyrl\[math\]'"):
        MathVerifier(timeout_s=5)("\\boxed{2}", "2")


def test_tools_without_jsonschema_stop_with_the_install_line(monkeypatch):
    from polyrl.tools.function import validate_tool_schema

    monkeypatch.setitem(sys.modules, "jsonschema", None)
    schema = {"name": "add", "description": "a + b", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(ConfigError, match=r"pip install 'polyrl\[tools\]'"):
        validate_tool_schema(schema)
