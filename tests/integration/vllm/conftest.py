"""Import vLLM once, here, with its import-time warnings silenced.

The suite turns warnings into errors; importing vLLM 0.33.0 with torch 2.13.0 warns about
deprecations inside torch and vLLM themselves, which are not this project's to fix. Everything
the tests import from vLLM is imported here first, so later imports hit the module cache.
"""

from __future__ import annotations

import os
import warnings

for _name, _value in {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from . import harness  # noqa: F401  (imports vLLM's scheduler, runner mixin, config)
