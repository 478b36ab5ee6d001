"""Agent loops: how a sample becomes a trajectory (single-turn by default), and collation into a batch."""

from polyrl.agent_loops.runner import BatchingClient, collate, run_agent_loops
from polyrl.agent_loops.single_turn import SingleTurnAgentLoop

__all__ = ["BatchingClient", "SingleTurnAgentLoop", "collate", "run_agent_loops"]
