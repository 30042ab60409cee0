"""docs/vllm.md as the tests read it: its fenced blocks and the commands in them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "vllm.md").read_text()


def blocks(kind: str) -> list[str]:
    """The guide's fenced blocks of ``kind`` (``sh``, ``ini``, ...), in order."""
    return re.findall(rf"```{kind}\n(.*?)```", GUIDE, re.DOTALL)


def script(block: str) -> list[str]:
    """The block's commands: comments dropped, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #")[0].rstrip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]
