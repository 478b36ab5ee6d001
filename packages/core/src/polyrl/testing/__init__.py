"""``polyrl.testing``: an opt-in pytest plugin for plugin authors.

Enable it in a test module or ``conftest.py`` with ``pytest_plugins = ["polyrl.testing"]``.
It provides fixtures (:mod:`polyrl.testing.fixtures`: ``polyrl_plugins``,
``tiny_model_dir``, ``tiny_tokenizer``) and one conformance
base class per protocol:

```python
from polyrl.testing import RolloutConformance

class TestMyRollout(RolloutConformance):
    @pytest.fixture
    def rollout(self, tiny_model_dir): ...
```
"""

from polyrl.testing.conformance.advantage import AdvantageEstimatorConformance
from polyrl.testing.conformance.agent_loop import AgentLoopConformance
from polyrl.testing.conformance.engine import EngineConformance
from polyrl.testing.conformance.platform import PlatformConformance
from polyrl.testing.conformance.policy_loss import PolicyLossConformance
from polyrl.testing.conformance.reward import RewardFunctionConformance, RewardManagerConformance
from polyrl.testing.conformance.rollout import RolloutConformance
from polyrl.testing.fixtures import PluginHarness, polyrl_plugins, tiny_model_dir, tiny_tokenizer

__all__ = [
    "PluginHarness",
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
