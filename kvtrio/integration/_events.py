"""kvtrio's KV events in the engine's own KV event stream (vLLM's ``take_events``).

A router subscribed to an engine sees what the engine holds on its GPU; with
``kvtrio.events`` set, it also sees what the engine can load from kvtrio: the connector's
scheduler side relays the kvtrio server's events for the engine's tenant
(:class:`~kvtrio.client.EventRelay`) and hands them to vLLM's publisher at every step, with
kvtrio's ``medium`` (``CPU`` for its L1, ``STORAGE`` for L2, with ``locality`` and the backend's
label as ``ownership``) and the fields a router keys blocks by (``token_ids``,
``parent_block_hash``, ``extra_keys``, ``lora_name``, group fields). Every store that became
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
    structure_extra_keys,
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
                extra = _optional(vllm.BlockStored, event, _STORED_OPTIONAL)
                if event.extra_keys is not None and "extra_keys" in _fields(vllm.BlockStored):
                    extra["extra_keys"] = [
                        None if keys is None else tuple(keys) for keys in event.extra_keys
                    ]
                events.append(
                    vllm.BlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=event.block_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=event.lora_name,
                        **extra,
                    )
                )
            elif type(event) is BlockRemoved:
                self._held.get(event.medium or "", set()).difference_update(event.block_hashes)
                extra = _optional(vllm.BlockRemoved, event, _REMOVED_OPTIONAL)
                events.append(vllm.BlockRemoved(list(event.block_hashes), event.medium, **extra))
            elif type(event) is AllBlocksCleared:
                for medium, hashes in self._held.items():
                    if hashes:
                        events.append(vllm.BlockRemoved(list(hashes), medium or None))
                self._held.clear()
        return events

    def close(self) -> None:
        self.relay.close()


_STORED_OPTIONAL = (
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)
_REMOVED_OPTIONAL = ("group_idx", "locality", "ownership")


def _fields(cls: Any) -> tuple[str, ...]:
    return tuple(getattr(cls, "__struct_fields__", ()))


def _optional(cls: Any, event: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The optional fields of ``event`` that are set and that this vLLM's ``cls`` has."""
    fields = _fields(cls)
    return {n: getattr(event, n) for n in names if n in fields and getattr(event, n) is not None}


class BlockNames(list[int | bytes]):
    """Blocks' hashes as vLLM's KV events name them, with the rest of what its
    ``BlockStored`` says of them: ``extra_keys`` (one entry per block, or None when no block
    has any) and ``lora_name`` (``""``: none)."""

    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_name: str = ""


def event_hashes_of(as_int: bool, block_size: int = 0) -> Any:
    """``event_hashes(request, first, stop)``: the request's block hashes of blocks
    ``[first, stop)`` as vLLM's KV events name them (``maybe_convert_block_hash``: ``as_int``
    is ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), as :class:`BlockNames` with their extra keys
    (blocks of ``block_size`` tokens; 0: none) and LoRA adapter as vLLM's own events give
    them."""

    def event_hashes(request: Any, first: int, stop: int) -> BlockNames:
        names = BlockNames(
            event_block_hash(bytes(h), as_int=as_int) for h in request.block_hashes[first:stop]
        )
        lora = getattr(request, "lora_request", None)
        names.lora_name = str(getattr(lora, "lora_name", "") or "") if lora is not None else ""
        if block_size > 0:
            names.extra_keys = extra_keys_of(request, block_size, first, first + len(names))
        return names

    return event_hashes


def extra_keys_of(
    request: Any, size: int, first: int, stop: int
) -> tuple[tuple[Any, ...] | None, ...] | None:
    """The extra keys of the request's blocks ``[first, stop)`` (of ``size`` tokens) as
    vLLM's ``BlockStored`` publishes them (``generate_block_hash_extra_keys`` and
    ``to_event_extra_keys``: the LoRA name, ``(mm_identifier, offset)`` pairs, the cache salt
    on the prompt's first block, prompt-embedding digests), one entry per block; None when no
    block has any, when this vLLM has no such functions, or when they are not what a store may
    carry (the store goes without them)."""
    if not (
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return None  # (the common case, without a call per block)
    try:
        from vllm.v1.core import kv_cache_utils as utils

        mm_index, keys = 0, []
        for block in range(first, stop):
            found, mm_index = utils.generate_block_hash_extra_keys(
                request, block * size, (block + 1) * size, mm_index
            )
            keys.append(found)
        if not any(k is not None for k in keys):
            return None
        converted = utils.to_event_extra_keys(keys)
        if converted is None:
            return None
        entries = tuple(None if k is None else tuple(_tupled(x) for x in k) for k in converted)
        return structure_extra_keys(entries, None)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None  # (a store without extra keys is still a store)


def _tupled(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
