"""The entry-point registry: lazy loading, readable errors, option parsing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import pytest

from kvtrio.config import BackendSpec, load_config, parse_backend_spec
from kvtrio.errors import ConfigError
from kvtrio.l2 import GROUP, create_backend, describe_backends, register, unregister
from kvtrio.l2.disk import DiskBackend
from kvtrio.l2.memory import MemoryBackend
from kvtrio.testing import FaultBackend


@pytest.fixture
def broken_plugin() -> Iterator[None]:
    register("broken", "kvtrio_no_such_module:Backend")
    try:
        yield
    finally:
        unregister("broken")


def test_our_backends_are_registered_like_plugins() -> None:
    names = {info.name for info in describe_backends()}
    assert {"disk", "memory"} <= names
    disk = next(info for info in describe_backends() if info.name == "disk")
    assert disk.error is None
    assert [option for option, _, _ in disk.options] == [
        "path",
        "capacity",
        "eviction",
        "fsync",
        "threads",
        "segment_size",
        "tenant_share",
    ]
    assert all(text for _, _, text in disk.options)


def test_the_fault_backend_is_for_tests_only() -> None:
    """kvtrio ships ``disk`` and ``memory``; ``fault`` injects failures, for tests."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    shipped = pyproject["project"]["entry-points"][GROUP]
    assert shipped == {
        "disk": "kvtrio.l2.disk:DiskBackend",
        "memory": "kvtrio.l2.memory:MemoryBackend",
    }


def test_a_test_registers_the_fault_backend_like_a_plugin(fault_registered: None) -> None:
    fault = next(info for info in describe_backends() if info.name == "fault")
    assert (fault.target, fault.error) == ("kvtrio.testing:FaultBackend", None)
    assert [option for option, _, _ in fault.options] == [
        "inner",
        "latency",
        "error_rate",
        "drop_rate",
        "seed",
    ]
    spec = parse_backend_spec("fault:inner=memory,latency=0.5,error_rate=0.25,seed=1")
    backend = create_backend(spec.name, spec.options)
    assert isinstance(backend, FaultBackend)
    assert isinstance(backend.inner, MemoryBackend)
    assert (backend.latency, backend.error_rate, backend.drop_rate) == (0.5, 0.25, 0.0)


def test_register_adds_a_backend_for_this_process_and_unregister_removes_it() -> None:
    assert "fault" not in {info.name for info in describe_backends()}
    register("fault", FaultBackend)  # the class, or "module:Class"
    try:
        register("fault", "kvtrio.testing._fault:FaultBackend")  # the same target again
        backend = create_backend("fault", {"inner": "memory"})
        assert isinstance(backend, FaultBackend)
        with pytest.raises(ConfigError, match="already"):
            register("fault", "kvtrio.l2.memory:MemoryBackend")
    finally:
        unregister("fault")
    with pytest.raises(ConfigError, match="no L2 backend named 'fault'"):
        create_backend("fault", {})


def test_register_refuses_to_shadow_an_installed_backend() -> None:
    with pytest.raises(ConfigError, match=r"'disk' is already kvtrio\.l2\.disk:DiskBackend"):
        register("disk", "kvtrio.l2.memory:MemoryBackend")
    register("disk", DiskBackend)  # what is installed: allowed, and changes nothing
    unregister("disk")
    assert create_backend("disk", {}).__class__ is DiskBackend
    with pytest.raises(ConfigError, match="module:Class"):
        register("x", "no_colon")


def test_a_backend_that_fails_to_import_is_reported_not_raised(broken_plugin: None) -> None:
    broken = next(info for info in describe_backends() if info.name == "broken")
    assert broken.error is not None
    assert "cannot be imported" in broken.error
    assert "ModuleNotFoundError" in broken.error
    with pytest.raises(ConfigError, match=r"broken.*cannot be imported"):
        create_backend("broken", {})


def test_unknown_backend_and_install_hints() -> None:
    with pytest.raises(ConfigError, match="no L2 backend named 'nope'"):
        create_backend("nope", {})


def test_options_are_typed_and_validated(tmp_path: Path) -> None:
    backend = create_backend("disk", {"path": str(tmp_path), "capacity": "1GiB", "fsync": "yes"})
    assert isinstance(backend, DiskBackend)
    assert (backend.options.capacity, backend.options.fsync) == (1 << 30, True)
    with pytest.raises(ConfigError, match="unknown option 'pth'"):
        create_backend("disk", {"pth": "x"})
    with pytest.raises(ConfigError, match="is not a size"):
        create_backend("disk", {"capacity": "lots"})
    with pytest.raises(ConfigError, match="expected true or false"):
        create_backend("disk", {"fsync": "maybe"})


def test_specs_from_flags_files_and_environment(tmp_path: Path) -> None:
    assert parse_backend_spec("redis:url=redis://h:1/0,ttl=30") == BackendSpec(
        "redis", {"url": "redis://h:1/0", "ttl": "30"}
    )
    with pytest.raises(ValueError, match="not key=value"):
        parse_backend_spec("disk:path")
    file = tmp_path / "kvtrio.toml"
    file.write_text('[[l2]]\nname = "disk"\npath = "/x"\n[[l2]]\nname = "memory"\n')
    assert load_config(config_file=file).l2 == (
        BackendSpec("disk", {"path": "/x"}),
        BackendSpec("memory"),
    )
    assert load_config({"l2": ["none"]}, config_file=file).l2 == ()
    assert load_config(environ={"KVTRIO_L2": "memory;disk"}).l2 == (
        BackendSpec("memory"),
        BackendSpec("disk"),
    )
    assert load_config().l2 == (BackendSpec("disk"),)


def test_kvtrio_backends_lists_options() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "backends"], capture_output=True, text=True, check=True
    ).stdout
    assert "disk  (kvtrio.l2.disk:DiskBackend)" in out
    assert "capacity" in out
