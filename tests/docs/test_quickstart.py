"""docs/quickstart.md, run as written: every ``sh`` block, in order, from the repository root.

The install line is checked to be the documented one and skipped (the suite runs in an
environment where kvtrio is installed); ``.venv/bin/`` is this environment's bin directory. The
fixed ports of the text are replaced by free ones, so that the test cannot collide with a
server already running on this machine.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q '.[plot]'"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", QUICKSTART.read_text(), re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_quickstart_commands_run_as_written(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    pytest.importorskip("matplotlib")
    lines = commands()
    assert lines[0] == INSTALL
    script = "\n".join(lines[1:])
    assert "kvtrio bench\n" in script + "\n"  # the defaults are run, not only variants
    bindir = str(Path(sys.executable).parent)
    script = (
        script.replace(".venv/bin/", bindir + "/")
        .replace("5577", str(free_port()))
        .replace("9464", str(free_port()))
    )
    # The documented bench.json / bench.png land in the repository root: write them elsewhere.
    script = script.replace("bench.json", str(tmp_path / "bench.json"))
    script = script.replace("bench.png", str(tmp_path / "bench.png"))
    run = subprocess.run(
        [
            "bash",
            "-c",
            "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        # The text's server takes the default disk L2 (~/.cache/kvtrio/l2), which one server
        # at a time may use (it is locked): give it one of its own, so that a server of the
        # user's, or this test run twice at once, cannot make it fail.
        env={**os.environ, "KVTRIO_L2": f"disk:path={tmp_path / 'l2'}"},
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert output.count("checksum failures") == 3  # three bench tables
    assert "serving\n" in run.stdout  # /healthz
    assert re.search(r'^kvtrio_lookup_hit_chunks_total\{tier="l1"\} [1-9]', run.stdout, re.M)
    assert '"phase": "serving"' in run.stdout  # kvtrio status --json
    assert "phase: serving" in run.stdout  # kvtrio status, the summary
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert '"checksum_failures": 0' in (tmp_path / "bench.json").read_text()
