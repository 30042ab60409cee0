"""Connectors that plug kvtrio into inference engines.

:mod:`kvtrio.integration.vllm` is vLLM's (``KvtrioConnector``); it is the only module that
imports the engine. The engine-neutral parts, which chunks to load and store, are in
:mod:`._planner`; the ``kvtrio.*`` options in :mod:`._options`.
"""
