"""``bench/ttft.py``, short: one prompt length, one round, on a 4-layer model of SmolLM2-135M's
layer shape, through every case (vLLM alone, kvtrio miss, hit from another live engine, L1 hit
in a new engine, disk L2 hit after a kvtrio restart).

Only correctness is asserted, never a time: every kvtrio case's tokens equal vLLM alone's, the
hit cases load tokens from kvtrio, and the bench writes its table, JSON and plot. Five vLLM
engines start (three side by side), each with its engine core and worker in its own process
(``--in-process``: ~12 s a start instead of ~30 s; what is checked does not depend on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "ttft.py"
LENGTH = 1024
CHUNK = 256


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ttft")
    command = [
        sys.executable, str(BENCH), "--model-shape", "smollm2-135m-4l", "--lengths", str(LENGTH),
        "--runs", "1", "--max-tokens", "8", "--out", str(out / "results"),
        "--cache-dir", str(out / "models"), "--in-process",
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, f"bench/ttft.py exited with {proc.returncode}:\n" + (
        proc.stdout[-6000:] + proc.stderr[-4000:]
    )
    data: dict[str, Any] = json.loads((out / "results" / "ttft.json").read_text())
    data["out"] = out / "results"
    data["stdout"] = proc.stdout
    return data


def test_every_case_ran_and_matches_vllm_alone(result: dict[str, Any]) -> None:
    assert result["problems"] == []
    runs = {run["case"]: run for run in result["runs"]}
    assert sorted(runs) == sorted(["vllm", "miss", "other", "l1", "l2"])
    reference = runs["vllm"]["token_ids"]
    assert len(reference) == 8
    for case, run in runs.items():
        assert run["length"] == LENGTH
        assert run["token_ids"] == reference, case
        assert run["match"], case


def test_the_output_depends_on_the_context(result: dict[str, Any]) -> None:
    """Equal tokens mean something only if the model's output depends on the earlier KV."""
    assert result["context_check"]["depends_on_context"]


def test_hits_load_whole_chunks_and_misses_none(result: dict[str, Any]) -> None:
    runs = {run["case"]: run for run in result["runs"]}
    assert runs["vllm"]["num_cached_tokens"] == 0
    assert runs["miss"]["num_cached_tokens"] == 0
    for case in ("other", "l1", "l2"):
        cached = runs[case]["num_cached_tokens"]
        # At least every whole chunk but the last (vLLM computes the prompt's last token).
        assert LENGTH - CHUNK <= cached < LENGTH, case


def test_l2_hits_came_from_disk_after_the_restart(result: dict[str, Any]) -> None:
    server = result["server"]
    assert server["after_restart"]["l1_ready"] == 0
    assert server["end"]["lookup_l2_chunks"] >= (LENGTH - CHUNK) // CHUNK
    assert server["end_disk"]["loads"] >= 1


def test_table_json_and_plot_are_written(result: dict[str, Any]) -> None:
    out: Path = result["out"]
    table = (out / "table.txt").read_text()
    for case in ("vllm", "miss", "other", "l1", "l2"):
        assert f" {case} " in table
    assert "TTFT ms" in table
    assert "float32" in table
    assert table.splitlines()[0] in result["stdout"]  # printed too
    assert {row["case"] for row in result["summary"]} == {"vllm", "miss", "other", "l1", "l2"}
    assert result["environment"]["vllm"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in result["stdout"]
    else:
        assert (out / "ttft.png").stat().st_size > 0
