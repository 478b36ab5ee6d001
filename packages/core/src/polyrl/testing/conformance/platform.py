"""Conformance suite for Platform implementations."""

from __future__ import annotations


class PlatformConformance:
    """Subclass in a test module and provide the fixtures named below; every test here must pass."""
