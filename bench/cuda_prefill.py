"""Prefill avoided, on the GPU: an 8B Llama's prefill time next to kvtrio's retrieve of its KV.

    python bench/cuda_prefill.py [--tokens 1024,4096,16384] [--repeats 3] [--layers 32]

GPU only (exits with a message elsewhere). The model is Llama-3-8B's architecture (hidden 4096,
32 layers, 32 query heads and 8 KV heads of 128, MLP 14336, vocabulary 128256) with random
weights in bfloat16 on GPU 0, built by the machine's ``transformers`` (no download): compute time
depends on the shape, not the values. For each prompt length it times the prefill (the forward
pass over the prompt, KV cache on, then the first token's logits: the time to first token
without a cache) and then, with the model freed, kvtrio's retrieve of that prompt's KV (32
layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 128 KiB per token) through a real ``kvtrio
serve`` into a CUDA worker's paged cache (``bench/_cuda_serve.py``; 256-token chunks, the
server's default). The KV retrieved has the prompt's size and layout, not the model's values.
``--layers`` builds fewer layers (prefill and KV shrink alike) where memory or time is short.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from typing import Any

import numpy as np
from _cuda_serve import CudaWorker, serve, shm_free

CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
CHUNK_TOKENS = 256


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.version.cuda and torch.cuda.is_available() else None


def prefill_times(torch: Any, layers: int, lengths: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of the prefill of a random prompt of each length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIG, num_hidden_layers=layers)
    torch.manual_seed(0)
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    # Built in bfloat16 directly (16 GB, not 32); a torch that refuses builds float32, then casts.
    with contextlib.suppress(TypeError, RuntimeError):
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda:0"):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(previous)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama-3-8B shape, {layers} layers, {params / 1e9:.2f} B parameters, bfloat16, "
          f"built in {time.perf_counter() - start:.1f} s")  # fmt: skip
    times = {}
    with torch.inference_mode():
        for length in lengths:
            ids = torch.randint(0, CONFIG["vocab_size"], (1, length), device="cuda:0")
            samples = []
            for _ in range(repeats + 1):  # the first is a warm-up
                torch.cuda.synchronize()
                begin = time.perf_counter()
                out = model.model(input_ids=ids, use_cache=True)
                model.lm_head(out.last_hidden_state[:, -1:])
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - begin)
                del out
            times[length] = statistics.median(samples[1:])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return times


def l1_for(kv: int) -> int:
    """L1 for one prompt's KV and headroom (each prompt is retrieved right after its store)."""
    return kv + max(256 << 20, kv // 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    torch = _torch()
    if torch is None:
        sys.exit("bench/cuda_prefill.py needs a CUDA GPU and torch built with CUDA; none here.")
    lengths = [int(t) for t in args.tokens.split(",")]
    kv_per_token = args.layers * 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 2
    fits = [n for n in lengths if l1_for(n * kv_per_token) + (64 << 20) <= shm_free()]
    if fits != lengths:
        print(f"/dev/shm has {shm_free() >> 20} MiB: prompts of "
              f"{sorted(set(lengths) - set(fits))} tokens do not fit an L1 there and are left "
              "out (docker: --shm-size)")  # fmt: skip
        lengths = fits
    if not lengths:
        sys.exit("bench/cuda_prefill.py: no prompt's KV fits /dev/shm")
    l1 = l1_for(max(lengths) * kv_per_token)
    print(torch.cuda.get_device_name(0))
    prefill = prefill_times(torch, args.layers, lengths, args.repeats)
    blocks = max(lengths) // 16
    rng = np.random.default_rng(0)
    with serve(CHUNK_TOKENS, l1) as server:
        heads, dim = CONFIG["num_key_value_heads"], CONFIG["head_dim"]
        worker = CudaWorker(
            torch, server.endpoint, args.layers, 2 * blocks, heads, dim, torch.bfloat16
        )
        try:
            for length in lengths:
                n = length // 16
                retrieves = []
                for _ in range(args.repeats + 1):  # the first is a warm-up
                    ids = rng.permutation(2 * blocks)[: 2 * n].tolist()
                    prompt = worker.prompt(length)
                    worker.store(prompt, ids[:n])
                    retrieves.append(worker.retrieve(prompt, ids[n:]))
                retrieve = statistics.median(retrieves[1:])
                kv = length * kv_per_token
                print(
                    f"prefill {length} tokens: {prefill[length] * 1e3:.1f} ms; kvtrio retrieve "
                    f"of its KV ({kv / (1 << 20):.0f} MiB): {retrieve * 1e3:.2f} ms "
                    f"({kv / retrieve / 1e9:.1f} GB/s) = {prefill[length] / retrieve:.1f}× faster"
                )
        finally:
            worker.close()


if __name__ == "__main__":
    main()
