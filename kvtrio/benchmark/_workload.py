"""The bench's workloads: multi-turn conversations (token mode) and Mooncake traces (hash mode).

Both are deterministic functions of the options, so the driver and every worker process build
the same workload on their own and only request numbers travel between them.

Every engine block of a prompt has a 64-bit *identity* that names it and everything before it
(like an engine's prefix hash): in token mode a hash chain over the blocks' token ids, in hash
mode the trace's block id and the block's place in it. The simulated engine derives the bytes of
a block's KV from its identity (see ``_content``), so equal prefixes have equal KV.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ._options import BenchError, BenchOptions

__all__ = ["TRACE_BLOCK_TOKENS", "BenchRequest", "Workload", "load_workload"]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry of a Mooncake trace."""
_VOCAB = 32_000

U64 = np.ndarray[Any, np.dtype[np.uint64]]


@attrs.frozen
class BenchRequest:
    """One request of a workload (prompt material is produced on demand by the workload)."""

    index: int
    tokens: int
    """Prompt length in tokens."""
    arrival: float = 0.0
    """Seconds after the start (trace timestamps; conversations start by their first turn)."""
    conversation: int = -1
    turn: int = 0


def _splitmix64(x: U64) -> U64:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))  # type: ignore[no-any-return]


class Workload:
    """Base: the requests and, per request, its prompt and block identities."""

    mode: str = ""
    hash_mode = False

    def __init__(self, requests: list[BenchRequest], block_size: int) -> None:
        self.requests = requests
        self.block_size = block_size

    def describe(self) -> str:
        raise NotImplementedError

    def prompt(self, index: int) -> dict[str, Any]:
        """``token_ids=`` or ``block_hashes=`` of the request, as the adapters take them."""
        raise NotImplementedError

    def identities(self, index: int) -> U64:
        """One identity per full engine block of the request's prompt."""
        raise NotImplementedError


class ChatWorkload(Workload):
    """Conversations of ``turns`` turns; conversation ``c`` uses system prompt ``c % G``.

    Turn ``t``'s prompt is the system prompt, then for each earlier turn its user message and
    the model's answer, then the turn's user message: each turn's prompt extends the previous
    one's, and conversations of one system prompt share its first chunks.
    """

    mode = "chat"

    def __init__(self, options: BenchOptions) -> None:
        rng = np.random.default_rng(options.seed)
        o = options
        self.options = o
        self.system = [
            rng.integers(0, _VOCAB, o.system_tokens, dtype=np.uint32)
            for _ in range(o.system_prompts)
        ]
        self.turns: list[list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]] = []
        requests: list[BenchRequest] = []
        gaps = rng.exponential(1 / o.rate, o.conversations) if o.rate > 0 else None
        start = 0.0
        for c in range(o.conversations):
            if gaps is not None:
                start = start + float(gaps[c]) if c else 0.0
            self.turns.append(
                [
                    (
                        rng.integers(0, _VOCAB, o.user_tokens, dtype=np.uint32),
                        rng.integers(0, _VOCAB, o.output_tokens, dtype=np.uint32),
                    )
                    for _ in range(o.turns)
                ]
            )
            for t in range(o.turns):
                length = o.system_tokens + t * (o.user_tokens + o.output_tokens) + o.user_tokens
                requests.append(BenchRequest(len(requests), length, start, c, t))
        super().__init__(requests, o.block_size)

    def describe(self) -> str:
        o = self.options
        return (
            f"{o.conversations} conversations × {o.turns} turns, {o.system_prompts} system "
            f"prompts of {o.system_tokens} tokens, {o.user_tokens} user + {o.output_tokens} "
            "answer tokens per turn"
        )

    def token_ids(self, index: int) -> np.ndarray[Any, Any]:
        request = self.requests[index]
        parts = [self.system[request.conversation % len(self.system)]]
        for t, (user, answer) in enumerate(self.turns[request.conversation][: request.turn + 1]):
            parts.append(user)
            if t < request.turn:
                parts.append(answer)
        return np.concatenate(parts)

    def prompt(self, index: int) -> dict[str, Any]:
        return {"token_ids": self.token_ids(index).tolist()}

    def identities(self, index: int) -> U64:
        tokens = self.token_ids(index)
        size = self.block_size
        out = np.empty(len(tokens) // size, np.uint64)
        previous = b"kvtrio-bench"
        for block in range(len(out)):
            previous = hashlib.blake2b(
                previous + tokens[block * size : (block + 1) * size].tobytes(), digest_size=8
            ).digest()
            out[block] = int.from_bytes(previous, "little")
        return out


class TraceWorkload(Workload):
    """A Mooncake trace: ``hash_ids`` name 512-token blocks (and everything before them).

    Engine block ``j`` of a request lies in trace block ``j * block_size // 512``; its engine
    block hash is that trace block's id and the engine block's place in it (16 bytes), which is
    prefix-chained because the trace's ids are.
    """

    mode = "trace"
    hash_mode = True

    def __init__(self, options: BenchOptions) -> None:
        assert options.trace is not None
        if TRACE_BLOCK_TOKENS % options.block_size:
            raise BenchError(
                f"--block-size {options.block_size} must divide the trace's {TRACE_BLOCK_TOKENS}"
                "-token blocks"
            )
        self.path = options.trace
        self.ids: list[list[int]] = []
        requests: list[BenchRequest] = []
        speed = options.speed
        for number, row in enumerate(_read_trace(options.trace), start=1):
            if options.limit and len(requests) >= options.limit:
                break
            length, ids, timestamp = _check_row(row, options.trace, number)
            self.ids.append(ids)
            arrival = timestamp / 1000 / speed if speed else 0.0
            requests.append(BenchRequest(len(requests), length, arrival))
        if not requests:
            raise BenchError(f"--trace {options.trace}: no requests in it")
        self.per_block = TRACE_BLOCK_TOKENS // options.block_size
        super().__init__(requests, options.block_size)

    def describe(self) -> str:
        return f"{len(self.requests)} requests of {self.path.name} (hash mode)"

    def _block_ids(self, index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        blocks = self.requests[index].tokens // self.block_size
        ids = np.repeat(np.asarray(self.ids[index], dtype=np.uint64), self.per_block)[:blocks]
        subs = np.tile(np.arange(self.per_block, dtype=np.uint64), len(self.ids[index]))[:blocks]
        return ids, subs

    def prompt(self, index: int) -> dict[str, Any]:
        ids, subs = self._block_ids(index)
        raw = np.stack([ids, subs], axis=1).astype("<u8").tobytes()
        return {"block_hashes": [raw[i : i + 16] for i in range(0, len(raw), 16)]}

    def identities(self, index: int) -> U64:
        ids, subs = self._block_ids(index)
        with np.errstate(over="ignore"):
            return _splitmix64(ids * np.uint64(1024) + subs)


def _read_trace(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise BenchError(f"{path}:{number}: not JSON ({exc.msg})") from None
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror}") from None


def _check_row(row: Any, path: Path, number: int) -> tuple[int, list[int], float]:
    try:
        length = row["input_length"]
        ids = row["hash_ids"]
        timestamp = row.get("timestamp", 0)
        if not (
            isinstance(length, int)
            and length >= 0
            and isinstance(ids, list)
            and all(isinstance(i, int) and 0 <= i < 2**53 for i in ids)
            and isinstance(timestamp, (int, float))
        ):
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise BenchError(
            f"{path}:{number}: expected {{timestamp, input_length, hash_ids}} with integers"
        ) from None
    # Tokens past the trace's blocks have no ids: they cannot be cached.
    length = min(length, len(ids) * TRACE_BLOCK_TOKENS)
    return length, ids, float(timestamp)


def load_workload(options: BenchOptions) -> Workload:
    """The workload the options describe (a trace when ``options.trace`` is set)."""
    if options.trace is not None:
        return TraceWorkload(options)
    return ChatWorkload(options)
