"""Blocking access to one Redis server or a Redis Cluster, for the backend's worker threads.

Both clients offer the same operations over already prefixed key names: ``exists``
(pipelined EXISTS), ``get_into`` / ``set_from`` (the zero-copy hot path of :mod:`._wire` on a
pooled connection, one pipelined batch per server), ``delete`` and ``close``; and ``check``,
which says what the server is when that is not what the options say (:data:`NOT_STANDALONE`,
:data:`NOT_CLUSTER`), else None. They raise redis-py's exceptions; the backend maps them.
Nothing connects before the first operation, and a connection that broke is replaced by
redis-py's pool on the next checkout, so both recover by themselves once the service is back.

In a cluster, keys are grouped by the node that serves their slot (redis-py's slot map). A key
whose fast path meets a redirect (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``) or a node
that cannot be reached is retried through redis-py's own cluster command, which follows
redirects and refreshes the slot map; the first failure there is raised.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import Any, TypeAlias, cast

import redis
from redis import exceptions
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ._wire import ReplyReader, connection_socket, pack_get, pack_set, send

__all__ = ["NOT_CLUSTER", "NOT_STANDALONE", "ClusterClient", "StandaloneClient"]

NOT_STANDALONE = (
    "is a Redis Cluster node (cluster_enabled:1; it would answer MOVED for other nodes' "
    "slots): set cluster=true"
)
NOT_CLUSTER = "is not a Redis Cluster node (cluster mode is not enabled there): remove cluster=true"

Views = Sequence[memoryview]
Reply: TypeAlias = "bool | exceptions.RedisError"
"""Per key: done (True), missing or of another size (False), or the error reply."""

# redis-py < 5.3 requires a command name here; later versions warn when one is given.
_CHECKOUT_ARGS: tuple[str, ...] = (
    ()
    if inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is not inspect.Parameter.empty
    else ("GET",)
)

# Error replies that say "ask the cluster again" rather than "this failed".
_REDIRECTS = (exceptions.AskError, exceptions.TryAgainError, exceptions.ClusterDownError)


def _fast(
    pool: Any, names: Sequence[bytes], views: Sequence[Views], ttl_ms: int | None
) -> list[Reply]:
    """GET (``ttl_ms`` None) or SET every name on one connection of ``pool``, pipelined.

    Any exception leaves the connection disconnected (it may be out of step), then released.
    """
    connection = pool.get_connection(*_CHECKOUT_ARGS)
    try:
        if ttl_ms is None:
            pieces: list[bytes | memoryview] = [pack_get(name) for name in names]
        else:
            pieces = [
                p for name, v in zip(names, views, strict=True) for p in pack_set(name, v, ttl_ms)
            ]
        sock = connection_socket(connection)
        if sock is None:  # a connection class without a plain socket: redis-py reads replies
            return _through_redis_py(connection, pieces, views, ttl_ms is None)
        send(sock, pieces)
        reader = ReplyReader(sock)
        replies: list[Reply] = []
        for parts in views:
            if ttl_ms is None:
                length = reader.read_bulk_into(parts)
                if isinstance(length, exceptions.RedisError):
                    replies.append(length)
                else:
                    replies.append(length == sum(len(part) for part in parts))
            else:
                replies.append(reader.read_status() or True)
        return replies
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def _through_redis_py(
    connection: Any, pieces: list[bytes | memoryview], views: Sequence[Views], get: bool
) -> list[Reply]:
    connection.send_packed_command(pieces)
    replies: list[Reply] = []
    for parts in views:
        try:
            value = connection.read_response()
        except exceptions.ResponseError as exc:
            replies.append(exc)
            continue
        replies.append(_copy(value, parts) if get else True)
    return replies


def _copy(value: bytes | None, parts: Views) -> bool:
    """Copy a value into the parts if it has exactly their size."""
    if value is None or len(value) != sum(len(part) for part in parts):
        return False
    offset = 0
    for part in parts:
        part[:] = value[offset : offset + len(part)]
        offset += len(part)
    return True


def _stored(reply: Reply) -> bool:
    """A SET's outcome: an OOM refusal is a store that did not happen; other errors raise."""
    if isinstance(reply, exceptions.OutOfMemoryError):
        return False
    if isinstance(reply, exceptions.RedisError):
        raise reply
    return reply


def _loaded(reply: Reply) -> bool:
    if isinstance(reply, exceptions.RedisError):
        raise reply
    return reply


class StandaloneClient:
    """One Redis server through a redis-py pool of ``connections`` connections."""

    def __init__(self, url: str, connections: int, timeout: float) -> None:
        self.pool = redis.ConnectionPool.from_url(
            url,
            max_connections=connections,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # the backend reports failures; the server retries
        )
        self.redis = redis.Redis(connection_pool=self.pool)
        self.redirects = 0

    def check(self) -> str | None:
        """:data:`NOT_STANDALONE` where the server is a cluster node (``INFO cluster``); None
        otherwise, also where INFO is not allowed (an ACL): MOVED replies say it then."""
        try:
            # (typed a dict or an awaitable of one, depending on redis-py's version)
            info: Any = self.redis.info("cluster")
        except exceptions.ResponseError:
            return None
        enabled = info.get("cluster_enabled")
        return NOT_STANDALONE if str(enabled) == "1" else None

    def exists(self, names: Sequence[bytes]) -> list[bool]:
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(found) for found in pipe.execute()]

    def get_into(self, names: Sequence[bytes], views: Sequence[Views]) -> list[bool]:
        return [_loaded(reply) for reply in _fast(self.pool, names, views, None)]

    def set_from(self, names: Sequence[bytes], views: Sequence[Views], ttl_ms: int) -> list[bool]:
        return [_stored(reply) for reply in _fast(self.pool, names, views, ttl_ms)]

    def delete(self, names: Sequence[bytes]) -> None:
        self.redis.delete(*names)

    def close(self) -> None:
        """Close every connection, also those in use (their operations fail)."""
        self.pool.disconnect()


class ClusterClient:
    """A Redis Cluster found from any node's URL; connects on first use (in a worker thread)."""

    def __init__(self, url: str, connections: int, timeout: float) -> None:
        self.url = url
        self._options: dict[str, Any] = {
            "max_connections": connections,  # per node
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
        }
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()
        self.redirects = 0

    def cluster(self) -> RedisCluster:
        """The redis-py cluster client, created (which reads the slot map) on first use."""
        with self._lock:
            if self._cluster is None:
                self._cluster = RedisCluster.from_url(
                    self.url, retry=Retry(NoBackoff(), 1), **self._options
                )
            return self._cluster

    def check(self) -> str | None:
        """:data:`NOT_CLUSTER` where the node named is not in cluster mode; None once the
        slot map is read."""
        try:
            self.cluster()
        except exceptions.RedisClusterException as exc:
            if "cluster mode is not enabled" in str(exc).lower():
                return NOT_CLUSTER
            raise
        return None

    def exists(self, names: Sequence[bytes]) -> list[bool]:
        pipe = self.cluster().pipeline()  # type: ignore[no-untyped-call]
        for name in names:
            pipe.exists(name)
        return [bool(found) for found in pipe.execute()]

    def get_into(self, names: Sequence[bytes], views: Sequence[Views]) -> list[bool]:
        cluster = self.cluster()
        replies = self._by_node(cluster, names, views, None)
        results = []
        for name, parts, reply in zip(names, views, replies, strict=True):
            if reply is None:
                self._count_redirect()
                reply = _copy(cast("bytes | None", cluster.get(name)), parts)
            results.append(_loaded(reply))
        return results

    def set_from(self, names: Sequence[bytes], views: Sequence[Views], ttl_ms: int) -> list[bool]:
        cluster = self.cluster()
        replies = self._by_node(cluster, names, views, ttl_ms)
        results = []
        for name, parts, reply in zip(names, views, replies, strict=True):
            if reply is None:
                self._count_redirect()
                try:
                    reply = bool(cluster.set(name, b"".join(parts), px=ttl_ms or None))
                except exceptions.OutOfMemoryError:
                    reply = False
            results.append(_stored(reply))
        return results

    def delete(self, names: Sequence[bytes]) -> None:
        self.cluster().delete(*names)  # redis-py splits it by slot

    def close(self) -> None:
        with self._lock:
            cluster = self._cluster
        if cluster is None:
            return
        # RedisCluster.close() closes each node's Redis, but a node client made for from_url
        # does not own its pool and leaves the sockets open (redis-py 8.1): close them first.
        for node in cluster.get_nodes():  # type: ignore[no-untyped-call]
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        cluster.close()

    def _by_node(
        self,
        cluster: RedisCluster,
        names: Sequence[bytes],
        views: Sequence[Views],
        ttl_ms: int | None,
    ) -> list[Reply | None]:
        """The fast path, one batch per node; None where redis-py's own path must take over."""
        groups: dict[str, tuple[Any, list[int]]] = {}
        replies: list[Reply | None] = [None] * len(names)
        for index, name in enumerate(names):
            try:
                node = cluster.get_node_from_key(name)  # type: ignore[no-untyped-call]
            except exceptions.RedisClusterException:  # slot not covered (yet): the slow path
                continue
            pool = cluster.get_redis_connection(node).connection_pool
            groups.setdefault(node.name, (pool, []))[1].append(index)
        for pool, indexes in groups.values():
            try:
                batch = _fast(
                    pool, [names[i] for i in indexes], [views[i] for i in indexes], ttl_ms
                )
            except (exceptions.ConnectionError, exceptions.TimeoutError):
                continue  # the node is gone or moved: redis-py refreshes the map on the slow path
            for index, reply in zip(indexes, batch, strict=True):
                replies[index] = None if isinstance(reply, _REDIRECTS) else reply
        return replies

    def _count_redirect(self) -> None:
        with self._lock:
            self.redirects += 1
