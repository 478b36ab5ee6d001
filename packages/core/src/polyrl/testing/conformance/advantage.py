"""Conformance suite for AdvantageEstimator implementations."""

from __future__ import annotations


class AdvantageEstimatorConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
