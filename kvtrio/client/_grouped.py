"""One lookup for every KV cache group of an engine (vLLM's hybrid KV cache manager on).

Each group's chunks have keys of their own; a hit must be served by every group. A lookup
answers how many *leading* chunk hashes the server holds, so the groups' chunk hashes go
interleaved, position by position (chunk 0 of every group, then chunk 1 of every group, …),
each group asked only for what a hit at the end needs of it (a sliding window's last chunks):
the answer is a prefix every group holds of what it was asked. A state group (Mamba) holds its
state at one position only, the prompt's hit end: its one hash comes last, and a hit is then
all of it or nothing. One lookup, under the request's own id: the
pins, and the L2 → L1 loads the lookup starts, cover every group's chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs

from ..protocol import PromptChunks, prompt_chunks

__all__ = ["GroupedChunks", "grouped_chunks"]


@attrs.frozen
class GroupedChunks:
    """The chunk hashes of several groups, position by position (same shape as
    :class:`PromptChunks` where a lookup uses it: ``hashes``, ``chunk_size``, :meth:`covered`,
    :meth:`limited`). Group ``g`` is asked for its chunks from ``firsts[g]`` on (what a hit at
    the groups' end needs of it: all of a full-attention group's, a sliding window's last)."""

    groups: tuple[PromptChunks, ...]
    firsts: tuple[int, ...]
    state: bytes | None = None
    """The state group's chunk hash at the groups' end (its state there), if any."""

    @property
    def chunk_size(self) -> int:
        return self.groups[0].chunk_size

    @property
    def positions(self) -> int:
        return min(len(g.hashes) for g in self.groups)

    @functools.cached_property
    def hashes(self) -> tuple[bytes, ...]:
        asked = tuple(
            g.hashes[p]
            for p in range(self.positions)
            for g, first in zip(self.groups, self.firsts, strict=True)
            if p >= first
        )
        return asked + ((self.state,) if self.state is not None else ())

    def covered(self, chunks: int) -> int:
        """The tokens before the first position a lookup answering ``chunks`` leading hashes
        misses (every group holds what it was asked for before it); with a state group, the
        whole prompt or nothing. A hit short of the end is a candidate only: the windowed
        groups were asked for what a hit at the end needs."""
        count = 0
        for position in range(self.positions):
            need = sum(1 for first in self.firsts if position >= first)
            if count + need > chunks:
                return 0 if self.state is not None else self.groups[0].covered(position)
            count += need
        if self.state is not None and chunks <= count:
            return 0
        return self.groups[0].covered(self.positions)

    def limited(self, chunks: int) -> GroupedChunks:
        """At most ``chunks`` hashes (a lookup within the server's bounds): whole positions of
        every group's every chunk; none with a state group (its state is beyond the limit)."""
        if chunks >= len(self.hashes):
            return self
        keep = 0 if self.state is not None else max(0, chunks // len(self.groups))
        return GroupedChunks(
            tuple(g.limited(keep) for g in self.groups), tuple(0 for _ in self.groups)
        )


def grouped_chunks(
    chunk_size: int,
    block_size: int,
    groups: Sequence[tuple[Sequence[bytes | int], int]],
    state: Sequence[bytes | int] | None = None,
) -> GroupedChunks:
    """The chunks of each group (its block hashes and the first token a hit at their end
    needs of it, ``groups``), and of a state group (its block hashes, ``state``: the last
    chunk's hash names the state at their end). Raises as
    :func:`~kvtrio.protocol.prompt_chunks`; ``ValueError`` without groups."""
    if not groups:
        raise ValueError("a grouped lookup needs at least one group")
    chunks = tuple(
        prompt_chunks(chunk_size, block_size, block_hashes=hashes) for hashes, _ in groups
    )
    last = None
    if state is not None:
        state_chunks = prompt_chunks(chunk_size, block_size, block_hashes=state)
        last = state_chunks.hashes[-1] if state_chunks.hashes else None
    return GroupedChunks(chunks, tuple(first // chunk_size for _, first in groups), last)
