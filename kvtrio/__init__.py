"""kvtrio: a KV-cache server for LLM inference engines, built on trio and ZeroMQ."""

from ._version import __version__

__all__ = ["__version__"]
