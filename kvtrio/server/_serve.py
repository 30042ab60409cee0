"""Assembling a server: the root nursery, the router, the sessions nursery; start and stop."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio
import zmq

from .._logging import event
from ..config import ServerConfig
from ..errors import ConfigError
from ..l2 import Backend, create_backend
from ..options import ByteSize, format_size
from ..protocol import prepare_hooks
from ..shm import SharedArena, default_shm_dir
from ..storage import L1Cache, make_policy
from ..transport import ensure_endpoint_free, open_socket, serve_zap
from ._announce import Announcer, Recall, Tier, l2_tiers
from ._auth import ServerAuth, configure_auth
from ._events import EventPublisher
from ._http import bind_http, serve_http
from ._l1size import L1Plan, measure_room, plan_l1
from ._metrics import ServerMetrics
from ._operations import register_core_operations
from ._router import Router
from ._state import ServerState
from ._tenants import TenantArenas
from .cache import CacheService, CudaTransfers, RuntimeFactory
from .l2tier import open_l2_tier

__all__ = ["ServerHandle", "open_server", "serve"]

RECALL_QUEUE = 64
"""Requests for the names an L2 keeps (one per namespace registered or subscribed to) that may
wait for the L2 tier to start."""

log = logging.getLogger("kvtrio.server")

_HWM = 100_000
_REPLY_LINGER_MS = 1000
"""How long replies sent just before the server stops may still take to reach their clients."""


class ServerHandle:
    """What ``serve`` hands to its starter: where it listens, its state, how to stop it."""

    def __init__(
        self, state: ServerState, stop_scope: trio.CancelScope, http_url: str | None = None
    ) -> None:
        self.state = state
        self._stop_scope = stop_scope
        self.http_url = http_url
        """``http://HOST:PORT`` of the HTTP endpoint, or None if it is off."""

    @property
    def endpoint(self) -> str:
        """The endpoint the server is bound to (with the real port if 0 was asked for)."""
        return self.state.endpoint

    @property
    def instance_id(self) -> str:
        return self.state.instance_id

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain, then stop: new requests are refused with ``shutting_down``, accepted ones get
        their replies for up to ``grace`` seconds (default: the configured drain timeout), then
        every task of the server is cancelled and sessions clean up.

        Cancellation: if the caller is cancelled while draining, the server is stopped at once.
        """
        if grace is None:
            grace = self.state.config.drain_timeout
        self.state.draining = True
        try:
            log.info(
                "draining: %d requests in flight, %.1fs grace",
                self.state.pending,
                grace,
                extra=event("drain", in_flight=self.state.pending, grace_s=grace),
            )
            with trio.move_on_after(grace) as scope:
                await self.state.wait_drained()
            if scope.cancelled_caught:
                log.warning(
                    "drain timeout: stopping with %d requests unanswered",
                    self.state.pending,
                    extra=event("drain_timeout", unanswered=self.state.pending),
                )
        finally:
            self._stop_scope.cancel()

    def stop(self) -> None:
        """Stop now, without draining."""
        self._stop_scope.cancel()


def _router_options(config: ServerConfig, auth: ServerAuth) -> dict[int, int | bytes]:
    hard_limit = max(2 * config.max_message_size, config.max_message_size + (1 << 20))
    return {
        **auth.socket_options(),
        zmq.ROUTER_MANDATORY: 1,  # tell us when a peer is gone or full instead of dropping
        zmq.ROUTER_HANDOVER: 1,  # a client reconnecting with its routing id takes it over
        zmq.SNDHWM: _HWM,
        zmq.RCVHWM: _HWM,
        zmq.MAXMSGSIZE: hard_limit,  # beyond this libzmq drops the connection unread
    }


@asynccontextmanager
async def open_server(
    config: ServerConfig,
    *,
    backends: Sequence[tuple[str, Backend]] | None = None,
    cuda_runtime: RuntimeFactory | None = None,
) -> AsyncIterator[ServerHandle]:
    """Run a server for the duration of the block.

    The server is bound and serving when the block starts. Leaving the block, or
    :meth:`ServerHandle.shutdown` / :meth:`ServerHandle.stop` (which also cancel the block's body),
    stops it: sessions are cancelled and clean up, then the socket is closed.

    ``backends`` replaces the L2 cascade of ``config`` with ready-made backend instances (tests
    use it to hold on to a backend); they are closed when the server stops. ``cuda_runtime``
    replaces the CUDA runtime the first CUDA registration creates (tests pass a simulated one).
    """
    ensure_endpoint_free(config.endpoint)
    prepare_hooks()  # (not at a client's first request of each kind: cattrs' code generation)
    config, plan = size_l1(config)
    if plan.warning:
        log.warning("%s", plan.warning, extra=event("l1_size", warning=plan.warning))
    auth = configure_auth(config)  # first: a bad key file stops the start before anything runs
    names = (
        [name for name, _ in backends]
        if backends is not None
        else [spec.name for spec in config.l2]
    )
    # The announcer asks the L2 tier, made after it, for the names its backends keep: through a
    # bounded queue the tier serves once started (a full queue: asked again at the next occasion).
    ask_recall, recalls = trio.open_memory_channel[tuple[bytes, int]](RECALL_QUEUE)

    def recall(space: bytes, limit: int) -> bool:
        try:
            ask_recall.send_nowait((space, limit))
        except trio.WouldBlock:
            return False
        return True

    publisher = _events(config, auth, l2_tiers(names, config.l2), recall)
    announcer = publisher.announcer if publisher is not None else None
    http_socket = bind_http(config.http) if config.http else None
    try:
        if backends is None:
            backends = [(spec.name, create_backend(spec.name, spec.options)) for spec in config.l2]
        arena = create_arena(plan)
    except BaseException:
        if http_socket is not None:
            http_socket.close()
        raise
    try:
        await commit_arena(arena, plan)
    except BaseException:
        arena.close()
        if http_socket is not None:
            http_socket.close()
        raise
    # CURVE: a context of the server's own, whose ZAP handler (bound before the ROUTER, or
    # libzmq would accept any key) answers for this server alone.
    context = zmq.Context() if auth.curve else None
    arenas: TenantArenas | None = None
    try:
        with trio.CancelScope() as stop_scope:
            async with trio.open_nursery() as auth_tasks:
                if context is not None:
                    await auth_tasks.start(serve_zap, context, auth.authorize)
                try:
                    async with open_socket(
                        zmq.ROUTER,
                        options=_router_options(config, auth),
                        linger=_REPLY_LINGER_MS,
                        context=context,
                        pump=False,  # the router owns the socket's edge
                    ) as socket:
                        endpoint = socket.bind(config.endpoint, ipc_group=config.ipc_group)
                        log.info(
                            "%s",
                            auth.describe(endpoint),
                            extra=event("auth", mode=auth.mode, endpoint=endpoint),
                        )

                        def new_l1(size: int, base: int) -> L1Cache:
                            policy = make_policy(config.eviction)
                            return L1Cache(size, policy=policy, base=base, listener=announcer)

                        arenas = TenantArenas(
                            arena,
                            new_l1,
                            limit=config.l1_tenants,
                            directory=config.shm_dir or None,
                            group=config.ipc_group,
                        )
                        metrics = ServerMetrics(publisher.stats if publisher else None)
                        instance_id = uuid.uuid4().hex
                        async with open_l2_tier(
                            backends,
                            arenas.l1,
                            arenas.memory,
                            queue_size=config.write_behind_queue,
                            flushers=2,
                            loaders=config.l2_loaders,
                            observe=metrics.observe_l2,
                            tenants=arenas.tenant_count,
                            listener=announcer,
                            chunk_size=config.chunk_size,
                            instance=instance_id,
                            write_through=config.l2_write_through > 0,
                            admission=config.l2_admission,
                            recalls=recalls,
                        ) as l2:
                            cache = CacheService(
                                config, arenas, l2, CudaTransfers(cuda_runtime), announcer
                            )
                            state = ServerState(
                                config,
                                endpoint,
                                auth,
                                cache=cache,
                                observe_request=metrics.observe_request,
                                l1_sizing=plan.sizing,
                                instance_id=instance_id,
                                events=publisher,
                            )
                            register_core_operations(state)
                            cache.install(state)
                            async with trio.open_nursery() as root, trio.open_nursery() as sessions:
                                http_url = None
                                if http_socket is not None:  # first: /healthz says "starting"
                                    http_url = await root.start(
                                        serve_http, state, metrics, http_socket
                                    )
                                await root.start(_populate, arena)
                                if publisher is not None:
                                    await root.start(publisher.serve, context)
                                await l2.start()  # (the backends' health checks: before serving)
                                await root.start(cache.serve_reaper)
                                await root.start(state.heartbeats.run)
                                await root.start(cache.cuda.serve)
                                router = Router(state, socket, sessions)
                                await root.start(router.run)
                                state.serving = True
                                try:
                                    yield ServerHandle(state, stop_scope, http_url)
                                finally:
                                    state.serving = False
                                    root.cancel_scope.cancel()
                finally:
                    auth_tasks.cancel_scope.cancel()
    finally:
        arena.close()
        if arenas is not None:
            arenas.close()  # the tenants' arenas created since the start
        if http_socket is not None:
            http_socket.close()
        if context is not None:
            await _terminate(context)


def _events(
    config: ServerConfig, auth: ServerAuth, tiers: Mapping[str, Tier], recall: Recall
) -> EventPublisher | None:
    """The KV event publisher (``--events``) and its announcer (naming the L2 ``tiers``, asking
    the tier for the names it keeps with ``recall``), or none."""
    if not config.events:
        return None
    if config.events.startswith("tcp://") and auth.mode == "ipc":
        raise ConfigError(
            f"events: {config.events} is tcp:// but the server's endpoint is ipc:// (no CURVE "
            "keys to authenticate subscribers): publish on an ipc:// path too"
        )
    return EventPublisher(
        auth,
        endpoint=config.events,
        buffer=config.events_buffer,
        interval=config.events_interval,
        ipc_group=config.ipc_group,
        announce=lambda publish, subscribed: Announcer(
            publish, config.chunk_size, subscribed, tiers=tiers, recall=recall
        ),
    )


async def _terminate(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Terminate the server's own ZeroMQ context once its sockets are closed (shielded,
    bounded: libzmq may hold it for the sockets' linger; after that the thread is abandoned)."""
    with trio.CancelScope(shield=True), trio.move_on_after(2 * _REPLY_LINGER_MS / 1000):
        await trio.to_thread.run_sync(
            context.term, limiter=trio.CapacityLimiter(1), abandon_on_cancel=True
        )


async def commit_arena(arena: SharedArena, plan: L1Plan) -> None:
    """Allocate every page of the first L1 arena before the server serves (a worker thread).

    So "committed" in the start line is true when it is printed, and a ``/dev/shm`` that
    cannot hold the L1 stops the start in one line (:class:`ConfigError`) instead of a worker
    taking SIGBUS later. About 0.4 s per GiB here.

    Cancellation: the thread finishes its system call on its own descriptor; the result is
    abandoned (the caller closes and removes the arena).
    """
    started = trio.current_time()
    try:
        await trio.to_thread.run_sync(arena.allocate, abandon_on_cancel=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot commit the L1's {format_size(plan.arena)} in {plan.directory}: "
            f"{exc.strerror}; lower --l1-size, or give {plan.directory} more room"
        ) from None
    log.debug("L1 arena allocated in %.2fs", trio.current_time() - started)


_POPULATE_SHARE = 0.5
"""Of one CPU, what populating the L1's mapping after "serving" may take (it sleeps as long as
each slice took): the rest is the requests'."""


async def _populate(
    arena: SharedArena, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Map the arena's (allocated) pages into the server while it already serves, in a thread
    of its own, 16 MiB at a time (:func:`~kvtrio.shm.populate_pages`): it only spares first
    stores their page faults, and must not hold the answers up meanwhile.

    Not at a lower CPU priority: the thread holds the process's memory-map lock during each
    slice, and a ``nice 19`` thread preempted mid-slice by busy processes held it for seconds
    (a ping took 2.6 s under load: priority inversion). Cancellation (the server stops): the
    thread stops after its current slice, unwaited.
    """
    started = trio.current_time()
    stop = threading.Event()
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def work() -> None:
        try:
            arena.populate(stop, share=_POPULATE_SHARE)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

    threading.Thread(target=work, name="kvtrio-l1-populate", daemon=True).start()
    task_status.started()  # (the thread runs; the server does not wait for it)
    try:
        await done.wait()
    finally:
        stop.set()
    log.debug("L1 arena mapped in %.2fs", trio.current_time() - started)


def create_arena(plan: L1Plan) -> SharedArena:
    """Create the first shared-memory L1 arena of ``plan`` (the others come with their tenants).

    :func:`commit_arena` allocates its pages before the server serves, :func:`_populate` maps
    them once it runs; ``plan`` was checked against the directory's free space (a tmpfs
    smaller than the arena would SIGBUS a worker writing into it later; the usual culprit is a
    container's 64 MiB default ``/dev/shm``).
    """
    try:
        return SharedArena.create(plan.arena, directory=plan.directory)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the L1 arena in {plan.directory}: {exc.strerror}"
        ) from None


def size_l1(config: ServerConfig) -> tuple[ServerConfig, L1Plan]:
    """``config`` with ``l1_size`` decided (``--l1-size``, or sized from the machine: see
    ``_l1size``), and the plan that says why. :class:`ConfigError` if it does not fit."""
    plan = plan_l1(config, measure_room(config.shm_dir or default_shm_dir()))
    return attrs.evolve(config, l1_size=ByteSize(plan.size)), plan


async def serve(
    config: ServerConfig,
    *,
    backends: Sequence[tuple[str, Backend]] | None = None,
    cuda_runtime: RuntimeFactory | None = None,
    task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until :meth:`ServerHandle.shutdown` or cancellation.

    Start it with ``handle = await nursery.start(serve, config)``; the handle is passed to
    ``task_status.started`` once the socket is bound.
    """
    async with open_server(config, backends=backends, cuda_runtime=cuda_runtime) as handle:
        task_status.started(handle)
        await trio.sleep_forever()
