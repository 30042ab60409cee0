"""What ``bench/serve.py`` feeds vLLM's benchmark client: the served model directory (the
random-weight model of ``bench/_ttft_model.py`` plus a tokenizer written offline) and, per run,
the client's dataset arguments for each workload (``mooncake``, ``multiturn``, ``random``).

Pure file writing, no engine: everything here is deterministic in its seed, so every case of
one (repetition, workload, rate) gets the same requests.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from _ttft_model import SHAPES, write_model

__all__ = [
    "WORKLOADS",
    "Workload",
    "mooncake_slice",
    "multiturn_rows",
    "served_model",
]

WORKLOADS = ("mooncake", "multiturn", "random")

SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the model config's bos 1 and eos 2


def _word(token: int) -> str:
    return SPECIAL[token] if token < len(SPECIAL) else f"t{token}"


def served_model(shape: str, cache_dir: Path, *, seed: int = 0) -> Path:
    """A directory vLLM's API server and its benchmark client both load offline: the model of
    ``write_model(shape)`` (its files linked, not copied) and a word-level tokenizer whose
    vocabulary is the model's (token ``i`` is the word ``t<i>``; ids 0–2 are ``<unk>``, ``<s>``,
    ``</s>``; words split on whitespace, nothing added to a prompt), so that a prompt's text is
    its token ids written out and decoding then encoding gives the same ids back."""
    model = write_model(shape, cache_dir, seed=seed)
    served = cache_dir / f"{model.name}-served"
    if (served / "tokenizer.json").exists():
        return served
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = SHAPES[shape]["vocab_size"]
    partial = cache_dir / f".{served.name}.{os.getpid()}.partial"
    partial.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (partial / name).symlink_to(model / name)
    vocab = {_word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(partial / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (partial / "special_tokens_map.json").write_text(json.dumps(special))
    (partial / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": SHAPES[shape]["max_position_embeddings"],
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                **special,
            }
        )
    )
    try:
        partial.rename(served)
    except OSError:  # another process finished first: use its copy
        for file in partial.iterdir():
            file.unlink()
        partial.rmdir()
    return served


# --------------------------------------------------------------------------- mooncake


def mooncake_slice(
    trace: Path,
    requests: int,
    seed: int,
    *,
    token_scale: float,
    output_scale: float,
    max_input: int,
    max_output: int,
) -> list[dict[str, Any]]:
    """About ``requests`` rows of the Mooncake trace, scaled to this machine.

    A run of consecutive rows shares almost nothing (the trace's median reuse distance is ~230
    requests), so whole *prefix groups* are drawn instead: rows whose first block id (and so,
    the ids being prefix-chained, every shared block) agree. Groups are drawn uniformly at
    random (seeded) until ``requests`` rows are in: each row is in with the same probability,
    and every row shares its blocks with all the rows it shares them with in the full trace.
    Rows keep their trace order and timestamps (shifted to start at 0). Lengths are scaled:
    input ``× token_scale`` (the client then expands each hash id into ``512 × token_scale``
    tokens), at most ``max_input``; output ``× output_scale``, between 2 and ``max_output``."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    groups: dict[int, list[int]] = defaultdict(list)
    for index, row in enumerate(rows):
        groups[row["hash_ids"][0] if row["hash_ids"] else -1 - index].append(index)
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    chosen: list[int] = []
    for key in order:
        if len(chosen) >= requests:
            break
        chosen += groups[key]
    chosen.sort()
    start = rows[chosen[0]]["timestamp"]
    out = []
    for index in chosen:
        row = rows[index]
        out.append(
            {
                "timestamp": row["timestamp"] - start,
                "input_length": max(1, min(max_input, round(row["input_length"] * token_scale))),
                "output_length": max(
                    2, min(max_output, round(row["output_length"] * output_scale))
                ),
                "hash_ids": row["hash_ids"],
            }
        )
    return out


# --------------------------------------------------------------------------- multi-turn


def multiturn_rows(
    requests: int,
    seed: int,
    rate: float,
    *,
    turns: int = 6,
    system_blocks: int = 8,
    user_blocks: int = 3,
    reply_blocks: int = 2,
    output_tokens: int = 32,
    block: int = 32,
) -> list[dict[str, Any]]:
    """Chats whose history grows each turn, several users interleaved, in request order, as
    rows of a timed trace (the client's ``timed_trace`` dataset: ``hash_ids`` of ``block``-token
    blocks, each id always the same tokens within a run).

    Every user's conversation starts with one system prompt (the same for all users, as an
    application's), then per turn a user message; turn ``t``'s prompt is the system prompt,
    every earlier turn's message and a reply, and the new message. The replies are written
    here (new blocks, as a client resending the model's earlier answers would), not taken
    from the engine's outputs: the requests are fixed in advance. Users take turns round-robin
    (turn 1 of every user, then turn 2, …): the next turn of one user comes ``users`` requests
    later. ``ceil(requests / turns)`` users; the last round may be short. Arrivals: a Poisson
    process at ``rate`` per second (seeded), ``timestamp`` in milliseconds."""
    rng = random.Random(seed)
    next_id = system_blocks

    def blocks(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    users = max(1, math.ceil(requests / turns))
    history = [list(range(system_blocks)) for _ in range(users)]
    rows: list[dict[str, Any]] = []
    clock = 0.0
    for _turn in range(turns):
        for user in range(users):
            if len(rows) >= requests:
                return rows
            prompt = history[user] + blocks(user_blocks)
            rows.append(
                {
                    "timestamp": round(clock * 1000, 3),
                    "input_length": len(prompt) * block,
                    "output_length": output_tokens,
                    "hash_ids": prompt,
                    "user": user,
                }
            )
            clock += rng.expovariate(rate)
            history[user] = prompt + blocks(reply_blocks)
    return rows


# --------------------------------------------------------------------------- client arguments


class Workload:
    """Turns (workload, offered rate, seed) into vLLM benchmark client arguments, writing the
    dataset files it needs under ``workdir``."""

    def __init__(self, args: Any, vocab_size: int, workdir: Path) -> None:
        self.args = args
        self.vocab_size = vocab_size
        self.workdir = workdir

    def requests(self, rate: float) -> int:
        """Requests per run: ``rate × duration``, at least 8."""
        return max(8, round(rate * self.args.duration))

    def client_args(self, name: str, rate: float, seed: int) -> tuple[list[str], dict[str, Any]]:
        """The client's dataset and rate arguments, and what the bench records about them."""
        n = self.requests(rate)
        if name == "random":
            return [
                "--dataset-name", "random", "--num-prompts", str(n), "--request-rate", str(rate),
                "--random-input-len", str(self.args.random_input),
                "--random-output-len", str(self.args.output_tokens),
                "--random-range-ratio", "0", "--seed", str(seed),
            ], {"requests": n}  # fmt: skip
        if name == "multiturn":
            rows = multiturn_rows(
                n, seed, rate, turns=self.args.turns, output_tokens=self.args.output_tokens
            )
            return self._timed_trace(f"multiturn-{seed}-{n}", rows, 32, 0.001), {
                "requests": len(rows),
                "users": max(r["user"] for r in rows) + 1,
                "prompt_tokens_mean": sum(r["input_length"] for r in rows) / len(rows),
            }
        if name == "mooncake":
            rows = mooncake_slice(
                self.args.trace, n, seed, token_scale=self.args.token_scale,
                output_scale=self.args.output_scale, max_input=self.args.max_input,
                max_output=self.args.max_output,
            )  # fmt: skip
            span_ms = rows[-1]["timestamp"] or 1
            # Timestamps (ms) × multiplier = seconds: the slice's average rate is ``rate``.
            multiplier = len(rows) / rate / span_ms
            hashes = [
                h
                for r in rows
                for h in r["hash_ids"][: math.ceil(r["input_length"] / self._block())]
            ]
            return self._timed_trace(f"mooncake-{seed}-{n}", rows, self._block(), multiplier), {
                "requests": len(rows),
                "time_scale": multiplier * 1000,
                "block_reuse": 1 - len(set(hashes)) / max(1, len(hashes)),
                "prompt_tokens_mean": sum(r["input_length"] for r in rows) / len(rows),
                "output_tokens_mean": sum(r["output_length"] for r in rows) / len(rows),
            }  # fmt: skip
        raise ValueError(f"unknown workload {name!r}")

    def _timed_trace(
        self, name: str, rows: list[dict[str, Any]], block: int, multiplier: float
    ) -> list[str]:
        """Client arguments replaying ``rows`` (written to a file) with their own timing."""
        path = self.workdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return [
            "--dataset-name", "timed_trace", "--dataset-path", str(path),
            "--num-prompts", str(len(rows)), "--timed-trace-chunk-hash-size", str(block),
            "--timed-trace-sec-multiplier", repr(multiplier),
        ]  # fmt: skip

    def _block(self) -> int:
        """Tokens per trace hash id once scaled (512 in the trace)."""
        return max(1, round(512 * self.args.token_scale))
