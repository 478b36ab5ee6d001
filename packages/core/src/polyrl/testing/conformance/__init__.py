"""Conformance suites, one module per protocol."""
