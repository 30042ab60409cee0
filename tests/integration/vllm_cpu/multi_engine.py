"""Run a real vLLM CPU engine with kvtrio first in vLLM's ``MultiConnector``, vLLM's
``ExampleConnector`` second, over token prompts, greedy (``test_multi_connector.py``).

    python multi_engine.py MODEL_DIR JOB.json RESULTS.json

``JOB.json``: ``{"kvtrio": URL, "example": DIR, "prompts": [{"id", "tokens", "max_tokens",
"wait_ready"}]}`` (as ``engine.py``'s); ``RESULTS.json`` gets, per prompt, the generated token
ids, ``num_cached_tokens`` and the request's ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from engine import ENV, wait_ready  # (run as a script: this folder is on sys.path)


def main() -> None:
    model, job_path, results_path = sys.argv[1:4]
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kvtrio = {
        "kv_connector": "KvtrioConnector",
        "kv_connector_module_path": "kvtrio.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtrio.url": job["kvtrio"]},
    }
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": job["example"]},
    }
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,  # so that every cached token is a connector's
        seed=0,
        max_model_len=2048,
        dtype="float32",
        kv_transfer_config={
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [kvtrio, example]},
        },
    )
    results = []
    for prompt in job["prompts"]:
        if prompt.get("wait_ready"):
            wait_ready(job["kvtrio"], prompt["wait_ready"])
        params = SamplingParams(temperature=0, max_tokens=prompt["max_tokens"], seed=0)
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt["tokens"])], params)
        results.append(
            {
                "id": prompt["id"],
                "token_ids": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens,
                "kv_transfer_params": output.kv_transfer_params,
            }
        )
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the import side
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    main()
