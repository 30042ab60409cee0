"""Issue 32: every field a client sends has a declared range or length (``FIELD_BOUNDS``),
documented in ``docs/protocol.md`` and checked at decode."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from kvtrio.errors import ErrorCode, ProtocolError
from kvtrio.protocol import (
    FIELD_BOUNDS,
    MAX_ID_LENGTH,
    MAX_MODEL_LENGTH,
    Lookup,
    Register,
    bound_rows,
    decode_request,
    encode_request,
)

from .._support.bounds import HASH, VALID, boundary_cases, bounded_classes

DOC = Path(__file__).parents[2] / "docs" / "protocol.md"
CASES = list(boundary_cases())


def test_every_field_of_every_request_has_a_bound() -> None:
    declared = {cls: list(fields) for cls, fields in FIELD_BOUNDS.items()}
    assert declared.keys() == bounded_classes().keys()
    for cls, names in bounded_classes().items():
        assert sorted(declared[cls]) == sorted(names), cls.__name__
    assert VALID.keys() <= FIELD_BOUNDS.keys()


def test_the_documented_table_is_the_declared_one() -> None:
    """The table in docs/protocol.md cannot drift from the code: row for row."""
    text = DOC.read_text()
    section = text.split("## The range of every field", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.+) \|$", section, re.MULTILINE)
    assert documented == list(bound_rows())


@pytest.mark.parametrize(
    ("op", "body", "ok"),
    [(op, body, ok) for _, op, body, ok in CASES],
    ids=[label for label, *_ in CASES],
)
def test_each_field_at_and_beyond_its_bounds(op: str, body: bytes, ok: bool) -> None:
    if ok:
        decode_request(op, body)
        return
    with pytest.raises(ProtocolError) as info:
        decode_request(op, body)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert "\n" not in str(info.value)
    assert len(str(info.value)) < 400


def _decode(request: object) -> object:
    _, body = encode_request(1, request)  # type: ignore[arg-type]
    return decode_request(request.op, body)  # type: ignore[attr-defined]


def test_a_negative_reader_count_is_refused_naming_the_field_and_its_range() -> None:
    """Item 1: was answered as a hit, leaving l1_pins at -3."""
    with pytest.raises(ProtocolError, match=r"num_readers must be an integer in 0…256 .*got -3"):
        _decode(Lookup("r", "m", 1, (HASH,), num_readers=-3))


def test_ids_and_model_names_are_bounded_in_length() -> None:
    """Items 6 and 7: 1 MiB request ids and model names were accepted (and kept)."""
    with pytest.raises(ProtocolError, match=rf"request must be at most {MAX_ID_LENGTH} char"):
        _decode(Lookup("r" * (1 << 20), "m", 1, (HASH,)))
    with pytest.raises(ProtocolError, match=rf"model must be at most {MAX_MODEL_LENGTH} char"):
        _decode(Lookup("r", "m" * (1 << 20), 1, (HASH,)))
    with pytest.raises(ProtocolError, match=rf"engine must be at most {MAX_ID_LENGTH} char"):
        _decode(Lookup("r", "m", 1, (HASH,), engine="e" * (MAX_ID_LENGTH + 1)))
    _decode(Lookup("r" * MAX_ID_LENGTH, "m" * MAX_MODEL_LENGTH, 1, (HASH,)))


def test_a_rank_outside_the_world_is_refused_at_decode() -> None:
    register = VALID[Register]
    assert isinstance(register, Register)
    with pytest.raises(ProtocolError, match=r"rank must be in 0…3 \(below world_size\), got 4"):
        _decode(attrs.evolve(register, world_size=4, rank=4))
    with pytest.raises(ProtocolError, match=r"rank must be an integer in 0…255, got -1"):
        _decode(attrs.evolve(register, rank=-1))
