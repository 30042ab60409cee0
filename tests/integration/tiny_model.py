"""A small Llama-shaped model directory, written by the tests: no hub, no tokenizer.

``write_tiny_model(dir)`` writes only ``config.json`` (enough for vLLM's scheduler, or for an
engine with ``load_format="dummy"``); ``write_tiny_model(dir, weights=True)`` also writes seeded
random weights (``model.safetensors``, 7 MB in float32) whose attention really depends on the
context. vLLM's dummy weights (uniform in ±1e-3) do not: with them the prompt's last tokens alone
decide the output, so equal outputs would prove nothing about the KV of the prefix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _weights(seed: int, layers: int) -> dict[str, object]:
    import torch  # only the engine tests write weights; they have torch

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    head_dim = CONFIG["head_dim"]
    q_out = CONFIG["num_attention_heads"] * head_dim
    kv_out = CONFIG["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    scale = 1 / math.sqrt(hidden)
    tensors = {
        "model.embed_tokens.weight": normal(CONFIG["vocab_size"], hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(CONFIG["vocab_size"], hidden, std=scale),
    }
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            # Queries and keys large enough that attention picks tokens rather than averaging.
            prefix + "self_attn.q_proj.weight": normal(q_out, hidden, std=0.12),
            prefix + "self_attn.k_proj.weight": normal(kv_out, hidden, std=0.12),
            prefix + "self_attn.v_proj.weight": normal(kv_out, hidden, std=scale),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_out, std=2 * scale),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden, std=scale),
            prefix + "mlp.up_proj.weight": normal(inter, hidden, std=scale),
            prefix + "mlp.down_proj.weight": normal(hidden, inter, std=1 / math.sqrt(inter)),
        }
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def write_tiny_model(
    directory: Path,
    *,
    weights: bool = False,
    seed: int = 0,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int = 64,
) -> Path:
    """Write the tiny model into ``directory`` (``config.json``; with ``weights``, also
    ``model.safetensors``); return the directory. ``layer_types`` (one per layer,
    ``"full_attention"`` or ``"sliding_attention"``) makes it a hybrid: vLLM's Llama gives its
    sliding layers a window of ``sliding_window`` tokens (same weights); the model has as many
    layers as ``layer_types`` names (else 2)."""
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = dict(CONFIG)
    if layer_types is not None:
        config |= {
            "layer_types": list(layer_types),
            "sliding_window": sliding_window,
            "num_hidden_layers": len(layer_types),
        }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if weights:
        from safetensors.torch import save_file

        layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
        save_file(_weights(seed, layers), str(directory / "model.safetensors"))  # type: ignore[arg-type]
    return directory
