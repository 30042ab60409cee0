"""Test helpers for backend authors: the L2 conformance suite (needs pytest and pytest-trio)."""

from ._conformance import BackendConformance

__all__ = ["BackendConformance"]
