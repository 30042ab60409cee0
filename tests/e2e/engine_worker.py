"""A stand-in engine worker process for the end-to-end tests.

It owns a paged KV cache in ordinary CPU memory (numpy arrays, or torch tensors with --torch),
registers it through kvtrio's WorkerAdapter, and obeys JSON commands, one per line on stdin,
answering one JSON line each on stdout:

    {"cmd": "fill", "seed": 1}                        random KV data everywhere
    {"cmd": "digest", "blocks": [...]}                per-layer SHA-256 of those blocks' bytes
    {"cmd": "canonical", "blocks": [...]}             SHA-256 of them in the canonical format
    {"cmd": "store", "request": "r", "tokens": [...], "blocks": [...], "end": N}
    {"cmd": "retrieve", "request": "r", "tokens": [...], "blocks": [...], "end": N,
     "start": S, "skip": K}                          (start and skip optional)
    {"cmd": "wait", "request": "r", "timeout": 10}    until store/retrieve of r is done
    {"cmd": "finished", "requests": [...]}             get_finished(requests)
    {"cmd": "errors"}                                  get_block_ids_with_load_errors()
    {"cmd": "registered"}                              whether the adapter is registered
    {"cmd": "metrics"}                                 WorkerAdapter.metrics()
    {"cmd": "compute", "tokens": [...], "blocks": [...]}   write the prompt's KV into the blocks
    {"cmd": "scramble", "blocks": [...]}               overwrite the blocks with garbage
    {"cmd": "check", "tokens": [...], "blocks": [...], "start_block": B, "indices": [...]}
                                                       blocks not holding the prompt's KV
                                                       (of prompt block B + i, or indices[i])
    {"cmd": "exit"}

"The prompt's KV" of ``compute`` / ``check`` is a pure function of the tokens up to the end of
each block (as a real model's KV is of the prefix), so a test knows the right bytes of every
block without storing them.

Usage: python engine_worker.py ENDPOINT MODEL WORLD_SIZE RANK LAYOUT [--hash-mode] [--torch]
       [--engine ID] [--tenant NAME] [--store-at-once]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from typing import Any

import numpy as np

from kvtrio.client import LoadStoreOp, WorkerAdapter
from kvtrio.storage import HASH_SCHEME_TOKENS, block_hash_scheme
from kvtrio.transfer import gather

SHAPES = {  # small model: 4 layers, 256 blocks of 16 tokens, 2 heads × 32 dims
    "flash_attn": lambda nb: (2, nb, 16, 2, 32),
    "flash_infer": lambda nb: (nb, 2, 16, 2, 32),
    "cpu": lambda nb: (2, nb, 2, 16, 32),
    "vllm_cpu": lambda nb: (nb, 2, 2, 16, 32),
    "mla": lambda nb: (nb, 16, 48),
}
BLOCK_AXIS = {"flash_attn": 1, "flash_infer": 0, "cpu": 1, "vllm_cpu": 0, "mla": 0}
LAYERS, BLOCKS, BLOCK_SIZE = 4, 256, 16


def block_hashes(tokens: list[int]) -> list[bytes]:
    """A stand-in for an engine's prefix-chained block hashes."""
    hashes, previous = [], b""
    for i in range(len(tokens) // BLOCK_SIZE):
        previous = hashlib.sha256(previous + str(tokens[i * 16 : (i + 1) * 16]).encode()).digest()
        hashes.append(previous)
    return hashes


def prefix_digests(tokens: list[int]) -> list[bytes]:
    """Per full block: a digest of every token up to its end (what its KV depends on)."""
    digests, previous = [], b"kv"
    for i in range(len(tokens) // BLOCK_SIZE):
        block = np.asarray(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], dtype="<u4").tobytes()
        previous = hashlib.sha256(previous + block).digest()
        digests.append(previous)
    return digests


def block_view(arrays: list[Any], layout: str, layer: int, block: int) -> Any:
    return np.take(arrays[layer], [block], axis=BLOCK_AXIS[layout]).view(np.uint8)


def block_bytes(digest: bytes, layer: int, nbytes: int) -> Any:
    """The KV bytes of one block of one layer, derived from its prefix digest."""
    pattern = hashlib.sha256(digest + bytes([layer])).digest()
    return np.frombuffer(pattern * (nbytes // len(pattern) + 1), np.uint8)[:nbytes]


def write_block(arrays: list[Any], layout: str, block: int, data: list[Any]) -> None:
    axis = BLOCK_AXIS[layout]
    for layer, array in enumerate(arrays):
        index = [slice(None)] * array.ndim
        index[axis] = block
        shape = array[tuple(index)].shape
        array[tuple(index)] = data[layer].view(array.dtype).reshape(shape)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("model")
    parser.add_argument("world_size", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("layout")
    parser.add_argument("--hash-mode", action="store_true")
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--engine", default=None)
    parser.add_argument("--tenant", default="")
    # Submit a store of REQUEST, tokens range(TOKENS), right after registering.
    parser.add_argument("--store-at-once", nargs=2, metavar=("REQUEST", "TOKENS"), default=None)
    args = parser.parse_args()

    shape = SHAPES[args.layout](BLOCKS)
    if args.torch:
        import torch

        tensors: dict[str, Any] = {
            f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(LAYERS)
        }
        arrays = [t.view(torch.int16).numpy() for t in tensors.values()]
    else:
        arrays = [np.zeros(shape, dtype=np.float16) for _ in range(LAYERS)]
        tensors = {f"layer.{i}": a for i, a in enumerate(arrays)}
    scheme = block_hash_scheme("sha256-test") if args.hash_mode else HASH_SCHEME_TOKENS
    adapter = WorkerAdapter(
        args.endpoint,
        args.model,
        args.world_size,
        args.rank,
        BLOCK_SIZE,
        hash_scheme=scheme,
        timeout=3.0,
        tenant=args.tenant,
        **engine_kwargs(args.engine),
    )
    adapter.register_kv_caches(tensors, layout=args.layout)
    done: set[str] = set()
    if args.store_at_once is not None:  # an engine saving its first prompt at once
        request, count = args.store_at_once[0], int(args.store_at_once[1])
        tokens = list(range(count))
        blocks = list(range(count // BLOCK_SIZE))
        adapter.submit_store_request(
            request, LoadStoreOp(block_ids=blocks, token_ids=tokens, end=count)
        )

    def op(command: dict[str, Any]) -> LoadStoreOp:
        tokens = command["tokens"]
        prompt = {"block_hashes": block_hashes(tokens)} if args.hash_mode else {"token_ids": tokens}
        return LoadStoreOp(
            block_ids=command["blocks"],
            start=command.get("start", 0),
            end=command["end"],
            skip_first_n_tokens=command.get("skip", 0),
            **prompt,
        )

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        cmd = command["cmd"]
        reply: dict[str, Any] = {"ok": True}
        if cmd == "fill":
            rng = np.random.default_rng(command["seed"] + args.rank)
            for array in arrays:
                array.view(np.uint8)[...] = rng.integers(
                    0, 256, array.nbytes, dtype=np.uint8
                ).reshape(array.view(np.uint8).shape)
        elif cmd == "digest":
            axis = BLOCK_AXIS[args.layout]
            reply["digests"] = [
                hashlib.sha256(np.take(a, command["blocks"], axis=axis).tobytes()).hexdigest()
                for a in arrays
            ]
        elif cmd == "canonical":  # SHA-256 of the blocks in kvtrio's canonical chunk format
            layout = adapter.layout
            assert layout is not None
            out = np.empty(layout.chunk_nbytes(len(command["blocks"]) * BLOCK_SIZE), np.uint8)
            gather(layout, arrays, command["blocks"], out)
            reply["digest"] = hashlib.sha256(out.tobytes()).hexdigest()
        elif cmd == "store":
            adapter.submit_store_request(command["request"], op(command))
        elif cmd == "retrieve":
            adapter.submit_retrieve_request(command["request"], op(command))
        elif cmd == "wait":
            deadline = time.monotonic() + command.get("timeout", 10)
            while command["request"] not in done and time.monotonic() < deadline:
                stores, retrieves = adapter.get_finished([command["request"]])
                done |= stores | retrieves
                time.sleep(0.005)
            reply["done"] = command["request"] in done
            done.discard(command["request"])
        elif cmd == "errors":
            reply["blocks"] = sorted(adapter.get_block_ids_with_load_errors())
        elif cmd == "registered":
            reply["registered"] = adapter.registered
        elif cmd == "metrics":
            reply["metrics"] = adapter.metrics() if hasattr(adapter, "metrics") else {}
        elif cmd == "compute":
            nbytes = block_view(arrays, args.layout, 0, 0).nbytes
            for block, digest in zip(
                command["blocks"], prefix_digests(command["tokens"]), strict=False
            ):
                data = [block_bytes(digest, layer, nbytes) for layer in range(len(arrays))]
                write_block(arrays, args.layout, block, data)
        elif cmd == "scramble":
            nbytes = block_view(arrays, args.layout, 0, 0).nbytes
            for block in command["blocks"]:
                data = [block_bytes(b"junk", layer, nbytes) for layer in range(len(arrays))]
                write_block(arrays, args.layout, block, data)
        elif cmd == "check":
            nbytes = block_view(arrays, args.layout, 0, 0).nbytes
            digests = prefix_digests(command["tokens"])
            wrong = []
            for i, block in enumerate(command["blocks"]):
                indices = command.get("indices")
                digest = digests[indices[i] if indices else command.get("start_block", 0) + i]
                for layer in range(len(arrays)):
                    found = block_view(arrays, args.layout, layer, block).reshape(-1)
                    if not np.array_equal(found, block_bytes(digest, layer, nbytes)):
                        wrong.append(block)
                        break
            reply["wrong"] = wrong
        elif cmd == "exit":
            adapter.shutdown()
            print(json.dumps(reply), flush=True)
            return
        print(json.dumps(reply), flush=True)


def engine_kwargs(engine: str | None) -> dict[str, str]:
    """``engine_id`` for adapters that have it (the tests also run against older kvtrio)."""
    if engine is None or "engine_id" not in inspect.signature(WorkerAdapter).parameters:
        return {}
    return {"engine_id": engine}


if __name__ == "__main__":
    main()
