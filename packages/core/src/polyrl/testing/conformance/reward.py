"""Conformance suites for reward functions and reward managers."""

from __future__ import annotations


class RewardFunctionConformance:
    """Subclass and provide the fixtures named below; every test here must pass."""


class RewardManagerConformance:
    """Subclass and provide the fixtures named below; every test here must pass."""
