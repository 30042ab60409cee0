"""Tenant names (``protocol._tenant``): one alphabet, checked where a registration is decoded."""

from __future__ import annotations

import msgpack
import pytest

from kvtrio.errors import ErrorCode, ProtocolError
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    LayoutSpec,
    Register,
    decode_request,
    events_topic,
    tenant_problem,
)

LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 1, 16, "float16")


@pytest.mark.parametrize("name", ["", "acme", "a.b_c-D9", "x" * 64])
def test_tenant_names(name: str) -> None:
    assert tenant_problem(name) is None
    Register("e", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=name)


@pytest.mark.parametrize("name", ["a/b", "a b", "x" * 65, "caf\u00e9", "a\x00", "*"])
def test_registering_a_tenant_outside_the_alphabet_is_a_bad_request(name: str) -> None:
    """Issue 32, item 3: registering as ``a/b`` would have announced its chunks on a topic
    that tenant ``a``'s subscription receives."""
    assert tenant_problem(name) is not None
    body = {
        "engine": "e", "model": "m", "world_size": 1, "rank": 0, "hash_scheme": "h",
        "layout": {"kind": "flash_attn", "num_layers": 2, "num_blocks": 64, "block_size": 16,
                   "num_heads": 1, "head_dim": 16, "dtype": "float16"},
        "tenant": name,
    }  # fmt: skip
    with pytest.raises(ProtocolError) as raised:
        decode_request("register", msgpack.packb(body))
    assert raised.value.code == ErrorCode.BAD_REQUEST


def test_no_tenants_topic_prefixes_anothers() -> None:
    names = ["", "a", "a.", "a-b", "ab", "a_b", "b"]
    for one in names:
        for other in names:
            if one != other:
                assert not events_topic(other).startswith(events_topic(one))
