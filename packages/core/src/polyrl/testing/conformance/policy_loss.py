"""Conformance suite for PolicyLoss implementations."""

from __future__ import annotations


class PolicyLossConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
