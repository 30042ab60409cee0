"""Model directories for ``bench/ttft.py``: a served model's architecture with seeded random
weights, written once into a cache directory (no hub, no tokenizer).

Compute time and KV size depend on a model's shape, not on its values, so random weights time
like the real ones. They are drawn so that attention depends on the context (as in
``tests/integration/tiny_model.py``): queries and keys large enough that attention picks tokens
rather than averaging them, a small tied embedding that the layers' outputs swamp (with a large
tied embedding, ``h · e_t`` makes every model repeat its last input token, whatever the context),
and a final norm that sharpens the logits so that greedy choices are far from ties. Equal
greedy outputs with and without kvtrio therefore say the loaded KV was right.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "kv_bytes_per_token", "write_model"]

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M's config.json, less its tokenizer-related fields.
    "smollm2-135m": {
        **_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    # HuggingFaceTB/SmolLM2-360M's.
    "smollm2-360m": {
        **_COMMON,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
    },
    # SmolLM2-135M's layer shape with 4 layers and a small vocabulary: for CI and development
    # (the same kernels, ~7.5 times less compute per token).
    "smollm2-135m-4l": {
        **_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 8192,
    },
    # The 4-layer shape with gpt-oss's attention pattern (issue 34): sliding-window (128 tokens)
    # and full attention alternating, as vLLM's Llama reads ``layer_types``; vLLM's hybrid
    # KV cache manager makes two KV cache groups of it. Same size as smollm2-135m-4l.
    "gpt-oss-4l": {
        **_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 8192,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 128,
    },
}

_WEIGHTS_VERSION = 1
"""Bumped whenever :func:`_weights` draws other values: the cache key includes it."""


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """Bytes of K and V one token takes over all layers."""
    kv = 2 * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes
    return int(config["num_hidden_layers"] * kv)


def _weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    scale = 1 / math.sqrt(hidden)
    # q and k entries of about ±1.9 after the input norm (tiny_model.py's 0.12 at hidden 256):
    # attention logits of a few units, peaked but not one-hot.
    qk_std = 0.12 * math.sqrt(256 / hidden)
    tensors = {
        # Small and tied: the residual stream is the layers' output, not the input token's row.
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=0.02),
        # logits = norm(h) · E: std 0.02·√hidden ≈ 0.5 by itself; ×20 puts ties far apart.
        "model.norm.weight": torch.full((hidden,), 20.0),
    }
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            prefix + "self_attn.q_proj.weight": normal(q_out, hidden, std=qk_std),
            prefix + "self_attn.k_proj.weight": normal(kv_out, hidden, std=qk_std),
            prefix + "self_attn.v_proj.weight": normal(kv_out, hidden, std=scale),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_out, std=2 * scale),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden, std=scale),
            prefix + "mlp.up_proj.weight": normal(inter, hidden, std=scale),
            prefix + "mlp.down_proj.weight": normal(hidden, inter, std=1 / math.sqrt(inter)),
        }
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def write_model(shape: str, cache_dir: Path, *, seed: int = 0) -> Path:
    """The directory of ``shape`` with weights drawn from ``seed`` under ``cache_dir``, written
    first if it is not there yet (atomically: a directory renamed into place when complete)."""
    config = SHAPES[shape]
    key = json.dumps([config, seed, _WEIGHTS_VERSION], sort_keys=True).encode()
    directory = cache_dir / f"{shape}-seed{seed}-{hashlib.sha256(key).hexdigest()[:12]}"
    if (directory / "model.safetensors").exists():
        return directory
    from safetensors.torch import save_file

    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_dir / f".{directory.name}.{os.getpid()}.partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_weights(config, seed), str(partial / "model.safetensors"))
    try:
        partial.rename(directory)
    except OSError:  # another process finished first: use its copy
        for file in partial.iterdir():
            file.unlink()
        partial.rmdir()
    return directory
