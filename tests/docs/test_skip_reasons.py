"""Every skip says why in ``pytest -rs``, also one raised inside a trio test or fixture, which
pytest-trio re-raises without its message (the repository's ``conftest.py`` puts it back):
issue 32 counted 26 skips that said only "Skipped"."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import pytest
import trio


async def test_in_a_trio_test():
    await trio.sleep(0)
    pytest.skip("reason one")


@pytest.fixture
async def skipping():
    pytest.skip("reason two")
    yield


async def test_in_a_trio_fixture(skipping):
    pass


def test_in_a_plain_test():
    pytest.skip("reason three")
"""


def test_skips_in_trio_tests_keep_their_reason(tmp_path: Path) -> None:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert sorted(skips) == [
        "SKIPPED [1] test_probe.py:13: reason two",
        "SKIPPED [1] test_probe.py:22: reason three",
        "SKIPPED [1] test_probe.py:8: reason one",
    ], run.stdout
