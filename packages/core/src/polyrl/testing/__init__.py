"""``polyrl.testing``: an opt-in pytest plugin for plugin authors.

Enable it in a test module or ``conftest.py`` with ``pytest_plugins = ["polyrl.testing"]``.
It provides fixtures (:mod:`polyrl.testing.fixtures`: ``polyrl_plugin_manager``,
``polyrl_plugins``, ``tiny_model_dir``, ``tiny_tokenizer``) and one conformance
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
from polyrl.testing.conformance.platform import PlatformConformance  # noqa: E402
from polyrl.testing.conformance.policy_loss import PolicyLossConformance  # noqa: E402
from polyrl.testing.conformance.reward import RewardFunctionConformance, RewardManagerConformance  # noqa: E402
from polyrl.testing.conformance.rollout import RolloutConformance  # noqa: E402
from polyrl.testing.fixtures import (  # noqa: E402
    PluginHarness,
    polyrl_plugin_manager,
    polyrl_plugins,
    tiny_model_dir,
    tiny_tokenizer,
)

__all__ = [
    "PluginHarness",
    "polyrl_plugin_manager",
    "polyrl_plugins",
    "tiny_model_dir",
    "tiny_tokenizer",
    "AdvantageEstimatorConformance",
    "AgentLoopConformance",
    "EngineConformance",
    "PlatformConformance",
    "PolicyLossConformance",
    "RewardFunctionConformance",
    "RewardManagerConformance",
    "RolloutConformance",
]
