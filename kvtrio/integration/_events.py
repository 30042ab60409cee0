"""kvtrio's KV events in the engine's own KV event stream (vLLM's ``take_events``).

A router subscribed to an engine sees what the engine holds on its GPU; with
``kvtrio.events`` set, it also sees what the engine can load from kvtrio: the connector's
scheduler side relays the kvtrio server's events for the engine's tenant
(:class:`~kvtrio.client.EventRelay`) and hands them to vLLM's publisher at every step, with
kvtrio's ``medium`` (``CPU`` for its L1, the L2 backend's name). Every store that became
readable, by this engine or another one sharing the server, every L1 eviction and every L2
write, load and loss the server knows of: an engine connected to kvtrio can load all of them.
A restarted server's ``AllBlocksCleared`` is not relayed as such (it would clear the engine's
own GPU blocks at the router): it becomes ``BlockRemoved`` of everything relayed so far.

No vLLM import at import time: vLLM's event classes are imported when events are taken.
"""

from __future__ import annotations

from typing import Any

from ..client import EventRelay, curve_options
from ..protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    event_block_hash,
    events_topic,
    replay_endpoint,
)
from ._options import ConnectorOptions

__all__ = ["EngineEvents", "event_hashes_of"]


class EngineEvents:
    """kvtrio's events for one engine, as vLLM's event objects."""

    def __init__(self, options: ConnectorOptions) -> None:
        credentials = curve_options(
            options.events,
            "none" if options.insecure else options.server_key or None,
            options.client_key or None,
        )
        self.relay = EventRelay(
            options.events,
            replay_endpoint(options.events),
            events_topic(options.tenant),
            options=credentials,
        )
        self._held: dict[str, set[int | bytes]] = {}
        """What was relayed as stored, per medium (for a restarted server's removals)."""

    def take(self) -> list[Any]:
        """The events relayed since the last call, as vLLM's ``KVCacheEvent`` objects."""
        from vllm.distributed import kv_events as vllm

        events: list[Any] = []
        for event in self.relay.take():
            if type(event) is BlockStored:
                medium = event.medium or ""
                self._held.setdefault(medium, set()).update(event.block_hashes)
                events.append(
                    vllm.BlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=event.block_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        **_group_fields(event, stored=True),
                    )
                )
            elif type(event) is BlockRemoved:
                self._held.get(event.medium or "", set()).difference_update(event.block_hashes)
                events.append(
                    vllm.BlockRemoved(
                        list(event.block_hashes), event.medium, **_group_fields(event)
                    )
                )
            elif type(event) is AllBlocksCleared:
                for medium, hashes in self._held.items():
                    if hashes:
                        events.append(vllm.BlockRemoved(list(hashes), medium or None))
                self._held.clear()
        return events

    def close(self) -> None:
        self.relay.close()


def _group_fields(event: Any, *, stored: bool = False) -> dict[str, Any]:
    """The KV cache group fields of a server event, as vLLM's events name them (``group_idx``;
    stores also ``kv_cache_spec_kind``): relayed where the server's events carry them (a
    hybrid model's groups are kept apart, ``docs/vllm.md`` §7), omitted where they do not."""
    names = ("group_idx", "kv_cache_spec_kind") if stored else ("group_idx",)
    return {n: v for n in names if (v := getattr(event, n, None)) is not None}


def event_hashes_of(as_int: bool) -> Any:
    """``event_hashes(request, first, stop)``: the request's block hashes of blocks
    ``[first, stop)`` as vLLM's KV events name them (``maybe_convert_block_hash``: ``as_int``
    is ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""

    def event_hashes(request: Any, first: int, stop: int) -> list[int | bytes]:
        hashes = request.block_hashes[first:stop]
        return [event_block_hash(bytes(h), as_int=as_int) for h in hashes]

    return event_hashes
