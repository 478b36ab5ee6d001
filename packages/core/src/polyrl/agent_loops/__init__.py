"""Agent loops: how a sample becomes a trajectory (single-turn by default), and collation into a batch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyrl.agent_loops.runner import BatchingClient, agent_metrics, collate, fold_tool_rewards, run_agent_loops
    from polyrl.agent_loops.single_turn import SingleTurnAgentLoop
    from polyrl.agent_loops.tool_agent import ToolAgentLoop

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "BatchingClient": "polyrl.agent_loops.runner",
    "collate": "polyrl.agent_loops.runner",
    "run_agent_loops": "polyrl.agent_loops.runner",
    "SingleTurnAgentLoop": "polyrl.agent_loops.single_turn",
    "ToolAgentLoop": "polyrl.agent_loops.tool_agent",
    "agent_metrics": "polyrl.agent_loops.runner",
    "fold_tool_rewards": "polyrl.agent_loops.runner",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BatchingClient", "SingleTurnAgentLoop", "ToolAgentLoop", "agent_metrics", "collate",
           "fold_tool_rewards", "run_agent_loops"]
