"""Clients of a kvtrio server: :func:`open_client` for trio code, :class:`Client` for threads."""

from ._async import AsyncClient, open_client
from ._sync import Client

__all__ = ["AsyncClient", "Client", "open_client"]
