"""Conformance suite for Engine implementations."""

from __future__ import annotations


class EngineConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
