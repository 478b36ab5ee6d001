"""Built-in platforms pass the platform conformance suite; selection order; binding workers to devices."""

from __future__ import annotations

import pytest

from polyrl import hookimpl
from polyrl.errors import ConfigError
from polyrl.platforms import (
    CPUPlatform,
    CUDAPlatform,
    assign_visible_devices,
    detect_platform,
    node_local_ranks,
    select_platform,
    setup_worker_device,
)
from polyrl.testing import PlatformConformance


class TestCPU(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return CPUPlatform()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDAPlatform().is_available(), reason="needs a CUDA GPU (NVIDIA, not ROCm)")
class TestCUDA(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return CUDAPlatform()


def test_detect_prefers_available_highest_priority(monkeypatch):
    monkeypatch.delenv("POLYRL_PLATFORM", raising=False)
    expected = "cuda" if CUDAPlatform().is_available() else "cpu"
    assert detect_platform().name == expected


def test_every_registered_platform_is_named_as_registered():
    from polyrl.plugins import PluginManager

    registry = PluginManager(None, entry_points=False).registry("platform")
    for entry in registry.entries():
        assert entry.load()().name == entry.name


def test_the_suite_fails_a_broken_platform(tmp_path):
    class Broken(CPUPlatform):
        dist_backend = "carrier-pigeon"
        visible_devices_env = "CUDA_VISIBLE_DEVICES"  # but no ray_resource

        def memory_stats(self):
            return {"allocated_gib": -1}

    suite = PlatformConformance()
    for check in (suite.test_names, suite.test_worker_placement_attributes, suite.test_memory_and_cache):
        with pytest.raises(AssertionError):
            check(Broken())


def test_the_suite_fails_a_platform_that_does_not_restore_its_rng(tmp_path):
    class Forgetful(CPUPlatform):
        def set_rng_state(self, state):
            pass  # the state is silently dropped: a resumed run would draw other numbers

    with pytest.raises(AssertionError):
        PlatformConformance().test_rng_state_restores_the_device_stream(Forgetful(), tmp_path)


# ---------------------------------------------------------------------- selection order


class _Fake(CPUPlatform):
    available = True
    why = ""

    def is_available(self):
        return self.available

    def unavailable_reason(self):
        return self.why


class _High(_Fake):
    name = "high"
    available = False
    why = "no high device here"


class _Mid(_Fake):
    name = "mid"


class _FakePlatforms:
    @hookimpl
    def register_platforms(self, register):
        register("high", _High, priority=50)
        register("mid", _Mid, priority=5)


@pytest.fixture
def fakes(polyrl_plugins):
    polyrl_plugins.register(_FakePlatforms(), "fake-platforms")
    return polyrl_plugins.pm


def test_config_device_beats_the_environment_variable(fakes):
    choice = select_platform("cpu", fakes, environ={"POLYRL_PLATFORM": "mid"})
    assert choice.name == "cpu" and choice.reason == "trainer.device=cpu"


def test_environment_variable_beats_probing(fakes):
    choice = select_platform("auto", fakes, environ={"POLYRL_PLATFORM": "cpu"})
    assert choice.name == "cpu" and choice.reason == "POLYRL_PLATFORM=cpu"


def test_probing_takes_the_highest_priority_available_and_records_every_probe(fakes):
    choice = select_platform("auto", fakes, environ={})
    assert choice.name == "mid", choice  # 'high' (priority 50) probes unavailable
    assert "highest priority (5)" in choice.reason
    assert choice.probes["high"] == "not available: no high device here"
    assert choice.probes["mid"] == "available" and choice.probes["cpu"] == "available"


def test_cpu_is_the_fallback(fakes, monkeypatch):
    monkeypatch.setattr(_Mid, "available", False)
    monkeypatch.setattr(CPUPlatform, "is_available", lambda self: False)
    choice = select_platform("auto", fakes, environ={})
    assert choice.platform.name == "cpu" and choice.reason.startswith("fallback")


def test_a_named_platform_that_is_absent_stops_with_its_reason(fakes):
    with pytest.raises(ConfigError, match=r"platform 'high' \(POLYRL_PLATFORM=high\) is not available .*no high device"):
        select_platform("auto", fakes, environ={"POLYRL_PLATFORM": "high"})
    with pytest.raises(ConfigError, match=r"platform 'high' \(trainer.device=high\)"):
        select_platform("high", fakes, environ={})


def test_unknown_platform_names_the_plugin_to_install(fakes):
    if "npu" in fakes.registry("platform").names():
        pytest.skip("polyrl-hw-ascend is loaded here")
    with pytest.raises(Exception, match="polyrl-hw-ascend") as info:
        select_platform("npu", fakes, environ={})
    assert "cpu" in str(info.value) and "mid" in str(info.value)


def test_choice_is_logged_and_written_to_the_run_directory(fakes, tmp_path, caplog):
    import json
    import logging

    with caplog.at_level(logging.INFO, logger="polyrl.platforms"):
        choice = select_platform("auto", fakes, environ={})
    assert "platform mid (detected" in caplog.text
    written = json.loads(choice.write(tmp_path).read_text())
    assert written["name"] == "mid" and written["dist_backend"] == "gloo"
    assert written["probes"]["high"].startswith("not available")


# ---------------------------------------------------------------------- broken platform plugins


class _Raising(_Fake):
    """Its availability check raises (a plugin bug, or a device runtime that fails to load)."""

    name = "raising"

    def is_available(self):
        raise OSError("libfoo.so: cannot open shared object file\n(and a second line)")


class _Claiming(_Fake):
    """Says it is available but has no device: its device probe finds none."""

    name = "claiming"
    device_type = "meta"

    def device_count(self):
        return 0


class _ClaimingRaising(_Claiming):
    name = "claiming_raising"

    def device_count(self):
        raise RuntimeError("driver not loaded")


class _BrokenPlatforms:
    @hookimpl
    def register_platforms(self, register):
        register("raising", _Raising, priority=90)
        register("claiming", _Claiming, priority=80)
        register("claiming_raising", _ClaimingRaising, priority=70)


@pytest.fixture
def broken(polyrl_plugins):
    polyrl_plugins.register(_BrokenPlatforms(), "broken-platforms")
    return polyrl_plugins.pm


@pytest.mark.parametrize(("name", "needle"), [
    ("raising", "is_available() raised OSError: libfoo.so: cannot open shared object file"),
    ("claiming", "it says it is available, but its device probe found no meta device"),
    ("claiming_raising", "device probe (device_count()) raised RuntimeError: driver not loaded"),
])
def test_a_named_broken_platform_is_one_line_naming_its_plugin(broken, name, needle):
    with pytest.raises(ConfigError) as info:
        select_platform(name, broken, environ={})
    message = str(info.value)
    assert needle in message and "plugin 'broken-platforms'" in message and "\n" not in message, message


def test_auto_skips_broken_platforms_with_a_warning_and_records_their_probes(broken, caplog, tmp_path):
    import json
    import logging

    with caplog.at_level(logging.WARNING, logger="polyrl.platforms"):
        choice = select_platform("auto", broken, environ={})
    assert choice.name == "cpu"  # every broken one skipped, the next in priority order taken
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3 and all("broken-platforms" in w and "is skipped" in w for w in warned), warned
    probes = json.loads(choice.write(tmp_path).read_text())["probes"]
    assert probes["raising"].startswith("error: its is_available() raised OSError")
    assert probes["claiming"].startswith("error: it says it is available") and probes["cpu"] == "available"


def test_an_unavailable_reason_that_raises_does_not_hide_the_answer(fakes, monkeypatch):
    def boom(self):
        raise KeyError("x")

    monkeypatch.setattr(_High, "unavailable_reason", boom)
    with pytest.raises(ConfigError, match=r"is not available on this machine: \(its unavailable_reason\(\) raised"):
        select_platform("high", fakes, environ={})


# ---------------------------------------------------------------------- placement


def test_node_local_ranks():
    assert node_local_ranks(["a", "a", "b", "a", "b"]) == [0, 1, 0, 2, 1]
    assert node_local_ranks(["n"] * 3) == [0, 1, 2]  # one node: the rank


class _NPULike(CPUPlatform):
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"


@pytest.mark.parametrize("env,assigned,local_rank,index,after", [
    ({}, [], 3, 3, None),  # no Ray assignment (local executor): the node-local rank
    ({}, ["5"], 1, 0, "5"),  # Ray assigned device 5 and set nothing: we set it
    ({"ASCEND_RT_VISIBLE_DEVICES": "5"}, ["5"], 1, 0, "5"),  # Ray narrowed visibility already
    ({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, ["2"], 1, 2, "0,1,2,3"),  # NOSET: the whole node is visible
])
def test_assign_visible_devices(env, assigned, local_rank, index, after):
    assert assign_visible_devices(_NPULike(), local_rank=local_rank, assigned=assigned, environ=env) == index
    assert env.get("ASCEND_RT_VISIBLE_DEVICES") == after


def test_assign_visible_devices_refuses_a_conflicting_variable():
    env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(RuntimeError, match="ASCEND_RT_VISIBLE_DEVICES=0,1 does not include device 6"):
        assign_visible_devices(_NPULike(), local_rank=0, assigned=["6"], environ=env)


def test_cpu_ignores_device_assignment():
    assert assign_visible_devices(CPUPlatform(), local_rank=2, assigned=["1"], environ={}) == 2


def test_setup_worker_device_names_the_platform_and_sets_local_rank(fakes):
    env: dict[str, str] = {}
    platform, index = setup_worker_device("mid", fakes, local_rank=1, environ=env)
    assert platform.name == "mid" and index == 1 and env["LOCAL_RANK"] == "1"
    with pytest.raises(RuntimeError, match="platform 'high' is not available in this process: no high device"):
        setup_worker_device("high", fakes, local_rank=0, environ={})
