"""Conformance suite for Rollout implementations."""

from __future__ import annotations


class RolloutConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
