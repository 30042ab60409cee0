"""A stand-in for a vLLM request, as the connector's scheduler side reads one (for tests of the
scheduler side that need no vLLM)."""

from __future__ import annotations

__all__ = ["EngineRequest"]


class EngineRequest:
    """An engine request of ``tokens`` prompt tokens (ids 1000, 1001, …), nothing computed yet;
    no ``kv_transfer_params``, cache salt, LoRA adapter or multimodal input."""

    kv_transfer_params = None
    cache_salt = None
    lora_request = None
    mm_features = None

    def __init__(self, request_id: str, tokens: int = 200) -> None:
        self.request_id = request_id
        self.all_token_ids = list(range(1000, 1000 + tokens))
        self.num_prompt_tokens = tokens
        self.num_computed_tokens = 0
