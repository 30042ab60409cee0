"""Object keys: namespaces and model profiles (the chunk hashes are tests/protocol)."""

from __future__ import annotations

from kvtrio.protocol import HASH_SCHEME_TOKENS
from kvtrio.storage import ModelProfile, namespace

PROFILE = ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 2, 1024, "float16", False)


def test_namespaces_separate_everything_that_matters() -> None:
    base = namespace("m", "", PROFILE, 2, 0)
    assert len(base) == 16
    assert base == namespace("m", "", PROFILE, 2, 0)
    others = [
        namespace("m2", "", PROFILE, 2, 0),
        namespace("m", "tenant", PROFILE, 2, 0),
        namespace("m", "", PROFILE, 4, 0),
        namespace("m", "", PROFILE, 2, 1),
        namespace(
            "m", "", ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 2, 1024, "bfloat16", False), 2, 0
        ),
    ]
    assert base not in others
    assert len(set(others)) == len(others)
    shared = ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 1, 576, "float16", True)
    assert namespace("m", "", shared, 2, 0) == namespace("m", "", shared, 2, 1)


def test_profile_differences_say_what_differs() -> None:
    other = ModelProfile("blocks/sha256/v1", 16, 32, 2, 1024, "bfloat16", False)
    assert PROFILE.differences(other) == [
        "hash_scheme: 'tokens/sha256-128/v1' vs 'blocks/sha256/v1'",
        "block_size: 0 vs 16",
        "dtype: 'float16' vs 'bfloat16'",
    ]
    assert PROFILE.differences(PROFILE) == []
    assert PROFILE.digest() != other.digest()
