"""``kvtrio bench``'s flags are made from :class:`BenchOptions` and read by the settings'
converter, as ``kvtrio serve``'s are: the same spellings, the same one-line errors."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvtrio.benchmark import BenchError, BenchOptions, options_from_args
from kvtrio.cli import _build_parser


def _options(*flags: str) -> BenchOptions:
    return options_from_args(_build_parser().parse_args(["bench", *flags]))


def test_no_flags_give_the_defaults() -> None:
    assert _options() == BenchOptions()


def test_every_field_has_its_flag() -> None:
    bench = next(
        action.choices["bench"]
        for action in _build_parser()._actions
        if isinstance(action.choices, dict) and "bench" in action.choices
    )
    dests = {action.dest for action in bench._actions}
    assert {field.name for field in attrs.fields(BenchOptions)} <= dests


def test_flags_are_read_as_settings_are() -> None:
    options = _options(
        *("--world-size", "4", "--heads", "1_024", "--rate", "2.5", "--l2", "none"),
        *("--l2", "memory", "--no-progress", "--held-out", "--json", "out.json"),
    )
    assert (options.world_size, options.heads, options.rate) == (4, 1024, 2.5)
    assert options.l2 == ("none", "memory")
    assert (options.progress, options.held_out, options.json) == (False, True, Path("out.json"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--world-size", "two"), "world_size = 'two' (from --world-size): expected an integer"),
        (("--world-size", "0"), "world_size = '0' (from --world-size): must be greater than 0"),
        (("--rate", "-1"), "rate = '-1' (from --rate): must not be negative"),
        (("--limit", "1.5"), "limit = '1.5' (from --limit): expected an integer"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(BenchError, match=r"^invalid setting: .*") as info:
        _options(*flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
