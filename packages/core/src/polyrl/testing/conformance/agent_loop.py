"""Conformance suite for AgentLoop implementations."""

from __future__ import annotations


class AgentLoopConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
