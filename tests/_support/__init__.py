"""Helpers the tests share (not fixtures: those are in ``conftest.py``): import them from here,
never from ``conftest`` or from another test module."""
