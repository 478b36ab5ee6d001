"""``polyrl.testing``: an opt-in pytest plugin for plugin authors.

Enable it in a test module or ``conftest.py`` with ``pytest_plugins = ["polyrl.testing"]``.
It provides fixtures (:mod:`polyrl.testing.fixtures`: ``polyrl_plugin_manager``,
``polyrl_plugins``, ``tiny_model_dir``, ``tiny_tokenizer``, ``tiny_vlm_dir``, ``real_model_dir``,
``real_model_gguf``) and one conformance
base class per protocol (``polyrl.testing.conformance``); see docs/plugins/testing.md:

```python
from polyrl.testing import RolloutConformance

class TestMyRollout(RolloutConformance):
    @pytest.fixture
    def rollout(self, tiny_model_dir): ...
```
"""

import pytest

# Rewrite the suites' asserts (as pytest does for test files) so a failing conformance check shows
# its values. Must run before the conformance modules are imported.
pytest.register_assert_rewrite("polyrl.testing.conformance")

from polyrl.testing.conformance.advantage import AdvantageEstimatorConformance  # noqa: E402
from polyrl.testing.conformance.agent_loop import AgentLoopConformance  # noqa: E402
from polyrl.testing.conformance.engine import EngineConformance  # noqa: E402
from polyrl.testing.conformance.environment import EnvironmentConformance  # noqa: E402
from polyrl.testing.conformance.platform import PlatformConformance  # noqa: E402
from polyrl.testing.conformance.policy_loss import PolicyLossConformance  # noqa: E402
from polyrl.testing.conformance.reward import RewardFunctionConformance, RewardManagerConformance  # noqa: E402
from polyrl.testing.conformance.rollout import RolloutConformance  # noqa: E402
from polyrl.testing.fixtures import (  # noqa: E402
    PluginHarness,
    polyrl_plugin_manager,
    polyrl_plugins,
    real_model_dir,
    real_model_gguf,
    tiny_model_dir,
    tiny_tokenizer,
    tiny_vlm_dir,
)

#: Markers for tests that need a device; a suite skips them where the platform probe fails.
DEVICE_MARKERS = {
    "gpu": "needs an NVIDIA GPU (the cuda platform)",
    "npu": "needs a Huawei Ascend NPU with torch-npu (the npu platform, polyrl-hw-ascend)",
    "rocm": "needs an AMD GPU with a ROCm build of torch (the rocm platform, polyrl-hw-rocm)",
}


#: The marker of a package's smoke tests: what ``make test-packages`` runs against the package installed alone
#: from its wheel (so they import nothing beyond its declared dependencies and pytest).
SMOKE_MARKER = "smoke: a fast check run on the package installed alone from its wheel (make test-packages)"


def pytest_configure(config: pytest.Config) -> None:
    """Register the device markers (``gpu``, ``npu``, ``rocm``) and ``smoke`` for every suite that uses this
    plugin."""
    for name, what in DEVICE_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line("markers", SMOKE_MARKER)


__all__ = [
    "DEVICE_MARKERS",
    "SMOKE_MARKER",
    "PluginHarness",
    "polyrl_plugin_manager",
    "polyrl_plugins",
    "tiny_model_dir",
    "tiny_tokenizer",
    "tiny_vlm_dir",
    "real_model_dir",
    "real_model_gguf",
    "AdvantageEstimatorConformance",
    "AgentLoopConformance",
    "EngineConformance",
    "EnvironmentConformance",
    "PlatformConformance",
    "PolicyLossConformance",
    "RewardFunctionConformance",
    "RewardManagerConformance",
    "RolloutConformance",
]
