"""Facts of the README and docs/ checked against the code and a real server (issue 32: the
"second log line" was the third, the CUDA path was "correct on an H200" in one place and "not
yet on a real GPU" in another, docs named a trace outside the repository, and `kvtrio serve … &`
then `kvtrio ping` raced)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text(path: Path) -> str:
    return " ".join(path.read_text().split())  # lines joined: phrases may wrap


def test_the_data_log_line_is_where_the_docs_say(
    server_process: Callable[..., ServerProcess],
) -> None:
    for doc in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        assert "`data:` log line, right after `serving on …`" in text(doc), doc.name
    for doc in DOCS:
        assert not re.search(r"(first|second|third) log line", text(doc)), doc.name
    server = server_process("--log-level", "info")
    server.stop()
    lines = server.log().splitlines()
    serving = next(i for i, line in enumerate(lines) if " serving on " in line)
    assert " INFO kvtrio: data: L1 " in lines[serving + 1]


def test_the_gpu_path_is_described_the_same_everywhere() -> None:
    """Its first version ran on an H200 (issue 24); the rebuilt one has not run on a GPU."""
    for doc in DOCS:
        body = text(doc)
        assert "not yet on a real GPU" not in body, doc.name
        for claim in re.finditer(r"correct on an H200", body):  # of the first version only
            assert body[: claim.start()].endswith("first version ran "), doc.name
    for doc in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        body = text(doc)
        assert "has not run on a GPU yet" in body, doc.name
        assert "first version ran correct on an H200" in body, doc.name


@pytest.mark.parametrize(
    "path", [*DOCS, ROOT / "bench" / "fleet.py"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_path_outside_the_repository(path: Path) -> None:
    """A clone has none of this machine's directories (the shared trace was one)."""
    assert "/work/" not in path.read_text()


def shell_lines(doc: Path) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", doc.read_text(), re.DOTALL)
    return [line for block in blocks for line in block.splitlines()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_a_ping_after_a_background_serve_waits_for_it(doc: Path) -> None:
    """`kvtrio serve … &` returns at once: the ping or status right after it must wait for the
    server (--timeout; `kvtrio bench --server` waits by itself)."""
    serving = False
    for line in shell_lines(doc):
        if "kvtrio serve" in line and line.split("#")[0].rstrip().endswith("&"):
            serving = True
        elif serving and re.search(r"kvtrio (ping|status|bench)\b", line):
            assert "kvtrio bench" in line or "--timeout" in line, line
            serving = False
