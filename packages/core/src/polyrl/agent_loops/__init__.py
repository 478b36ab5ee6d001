"""Agent loops: how a sample becomes a trajectory (single-turn by default), and collation into a batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.agent_loops.runner import BatchingClient, agent_metrics, collate, fold_tool_rewards, run_agent_loops
    from polyrl.agent_loops.single_turn import SingleTurnAgentLoop
    from polyrl.agent_loops.stepwise import StepwiseAgentLoop
    from polyrl.agent_loops.tool_agent import ToolAgentLoop

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "BatchingClient": "polyrl.agent_loops.runner",
    "collate": "polyrl.agent_loops.runner",
    "run_agent_loops": "polyrl.agent_loops.runner",
    "SingleTurnAgentLoop": "polyrl.agent_loops.single_turn",
    "StepwiseAgentLoop": "polyrl.agent_loops.stepwise",
    "ToolAgentLoop": "polyrl.agent_loops.tool_agent",
    "agent_metrics": "polyrl.agent_loops.runner",
    "fold_tool_rewards": "polyrl.agent_loops.runner",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = ["BatchingClient", "SingleTurnAgentLoop", "StepwiseAgentLoop", "ToolAgentLoop",
           "agent_metrics", "collate", "fold_tool_rewards", "run_agent_loops"]
