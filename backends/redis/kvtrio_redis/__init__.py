"""kvtrio-redis: the ``redis`` L2 backend of kvtrio (one Redis server or a Redis Cluster).

Installed, it registers itself under the ``kvtrio.backends`` entry-point group, so
``kvtrio serve --l2 redis:url=redis://cache:6379/0`` finds it.
"""

from ._backend import RedisBackend, RedisOptions

__all__ = ["RedisBackend", "RedisOptions"]

__version__ = "0.1.0"
