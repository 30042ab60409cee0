"""Generated traces for the eviction evaluator: multi-turn chat and agent runs.

Each generator returns :class:`~._simulate.SimRequest` lists, deterministic for a seed, whose
chunk keys are prefix-chained as a real engine's would be (a chunk's key names it and every
chunk before it): a request's prompt is its conversation's (or agent run's) history plus new
chunks, and its last chunk is usually partial (its key is the request's own: the next turn
extends that text, so the chunk's content, and key, differ).

- :func:`multi_turn_requests`: conversations arrive over time on one of a few shared system
  prompts; each has a geometric number of turns (many have one: their chunks are used once),
  each turn appending a question and the previous answer; the next turn comes after a think
  time during which other conversations' turns are served (long reuse distances).
- :func:`agent_requests`: agent runs on one of a few large tool prompts, each making many
  quick calls that append tool results; some calls retry from an earlier step (a branch); a
  few one-off batch prompts (a long document, never asked again) run between them.
"""

from __future__ import annotations

import random

from ._simulate import SimRequest

__all__ = ["agent_requests", "multi_turn_requests"]


class _Keys:
    """Fresh 8-byte chunk keys."""

    def __init__(self) -> None:
        self._next = 1 << 40

    def new(self, count: int) -> list[bytes]:
        start, self._next = self._next, self._next + count
        return [i.to_bytes(8, "little") for i in range(start, start + count)]


def _request(history: list[bytes], keys: _Keys, rng: random.Random) -> SimRequest:
    """A prompt of ``history``, plus a partial last chunk 9 times in 10."""
    if rng.random() < 0.9:
        return SimRequest((*history, *keys.new(1)), len(history))
    return SimRequest(tuple(history), len(history))


def multi_turn_requests(requests: int = 4000, seed: int = 1) -> list[SimRequest]:
    """Multi-turn chat (see the module docstring): ``requests`` requests."""
    rng = random.Random(seed)
    keys = _Keys()
    systems = [keys.new(rng.randint(2, 8)) for _ in range(6)]
    waiting: list[tuple[float, int, list[bytes], int]] = []  # (due, id, history, turns left)
    out: list[SimRequest] = []
    now = 0.0
    conversation = 0
    while len(out) < requests:
        now += rng.expovariate(1.0)
        if rng.random() < 0.35 or not waiting:  # a new conversation
            conversation += 1
            system = systems[min(int(rng.paretovariate(1.2)) - 1, len(systems) - 1)]
            history = [*system, *keys.new(rng.randint(2, 30))]
            turns = min(int(rng.expovariate(1 / 2.5)), 20)
        else:
            waiting.sort()
            if waiting[0][0] > now:
                now = waiting[0][0]
            _, _conversation, history, turns = waiting.pop(0)
            history = [*history, *keys.new(rng.randint(1, 10))]
            turns -= 1
        out.append(_request(history, keys, rng))
        if turns > 0:
            think = rng.lognormvariate(5.5, 1.0)  # median ~250 requests later, long tail
            waiting.append((now + think, conversation, history, turns))
    return out


def agent_requests(requests: int = 4000, seed: int = 2) -> list[SimRequest]:
    """Agent runs (see the module docstring): ``requests`` requests."""
    rng = random.Random(seed)
    keys = _Keys()
    tools = [keys.new(rng.randint(6, 16)) for _ in range(4)]
    active: list[list[list[bytes]]] = []  # per agent run: its steps' histories
    out: list[SimRequest] = []
    while len(out) < requests:
        roll = rng.random()
        if roll < 0.25:  # a one-off batch prompt: a long document, asked once
            out.append(_request(keys.new(rng.randint(8, 60)), keys, rng))
            continue
        if roll < 0.2 or not active:
            tool = tools[min(int(rng.paretovariate(1.5)) - 1, len(tools) - 1)]
            active.append([[*tool, *keys.new(rng.randint(1, 6))]])
            if len(active) > 160:  # the oldest agent run ends
                active.pop(0)
        steps = active[min(int(rng.expovariate(1 / 40)), len(active) - 1) - len(active)]
        if rng.random() < 0.15 and len(steps) > 1:  # retry from an earlier step
            base = steps[rng.randrange(len(steps) - 1)]
        else:
            base = steps[-1]
        history = [*base, *keys.new(rng.randint(1, 8))]
        steps.append(history)
        out.append(_request(history, keys, rng))
    return out
