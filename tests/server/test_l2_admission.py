"""L2 admission by predicted reuse (``l2tier/_admission``): the estimate and the decisions, no
I/O. The server's use of them (a real server over memory and disk L2s) is in
``test_l2_admission_server.py``."""

from __future__ import annotations

import hashlib
import logging

import pytest

from kvtrio.server.l2tier import Admission
from kvtrio.server.l2tier._admission import BACKLOG, FORGET, RETURNS, ReuseSketch


def key(name: str) -> bytes:
    """An object key as the server makes them: 16 bytes of namespace, 16 of chunk hash."""
    return b"N" * 16 + hashlib.sha256(name.encode()).digest()[:16]


def test_the_sketch_counts_from_zero_and_saturates() -> None:
    sketch = ReuseSketch()
    a = key("a")
    assert sketch.estimate(a) == 0
    sketch.add(a)
    assert sketch.estimate(a) == 1  # (the doorkeeper alone)
    sketch.add(a)
    assert sketch.estimate(a) == 2
    for _ in range(40):
        sketch.add(a)
    assert sketch.estimate(a) == 16  # doorkeeper + 4-bit counters at 15
    assert sketch.estimate(key("b")) == 0
    assert (sketch.first, sketch.again) == (1, 41)


def test_the_sketch_halves_every_sample_counts_and_forgets_keys_seen_once() -> None:
    sketch = ReuseSketch(sample=8)
    hot, once = key("hot"), key("once")
    for _ in range(6):
        sketch.add(hot)  # doorkeeper, then 5 in the counters
    sketch.add(once)
    assert (sketch.estimate(hot), sketch.estimate(once), sketch.halvings) == (6, 1, 0)
    sketch.add(key("eighth"))  # the 8th count: halved
    assert sketch.halvings == 1
    assert sketch.estimate(once) == 0  # (its doorkeeper bit is gone)
    assert sketch.estimate(hot) == 2  # 5 // 2 in the counters, out of the doorkeeper
    assert sketch.counted == 0


def test_the_sketch_rarely_mistakes_new_keys_for_seen_ones() -> None:
    sketch = ReuseSketch()
    for i in range(100_000):
        sketch.add(key(f"seen {i}"))
    mistaken = sum(sketch.estimate(key(f"new {i}")) > 0 for i in range(10_000))
    assert mistaken < 10  # (about 0.04 % at 100k keys in the doorkeeper's 4 Mbit)


def test_all_admits_every_chunk_and_counts_nothing() -> None:
    admission = Admission[str]("all")
    assert not admission.first_lookup("r1")
    assert all(admission.commit(key(f"c{i}"), None, "v") for i in range(10))
    assert (admission.admitted, admission.refused, admission.waiting) == (10, 0, 0)


def test_a_chunk_seen_once_is_refused_and_no_reuse_writes_nearly_nothing() -> None:
    """vLLM's ``random`` prompts: 2,000 of 16 chunks, none shared. A chunk is admitted only by
    a false positive of the doorkeeper (and then the rest of its prompt after it)."""
    admission = Admission[int]("reuse")
    for request in range(2_000):
        keys = [key(f"{request}/{c}") for c in range(16)]
        assert admission.first_lookup(request)
        admission.count(keys)
        parent = None
        for index, chunk in enumerate(keys):
            admission.commit(chunk, parent, index)
            parent = chunk
    assert admission.admitted <= 16  # (0.05 %; 0 with these keys)
    assert admission.admitted + admission.refused == 32_000
    assert not admission.returning


def test_a_chunk_two_requests_looked_up_is_admitted_at_its_commit() -> None:
    admission = Admission[None]("reuse")
    chunk = key("shared")
    for request in ("r1", "r2"):
        assert admission.first_lookup(request)
        admission.count([chunk])
    assert admission.commit(chunk, None, None)
    assert (admission.admitted, admission.refused) == (1, 0)


def test_a_repeated_lookup_of_one_request_counts_once() -> None:
    admission = Admission[None]("reuse")
    chunk = key("mine")
    assert admission.first_lookup("r1")
    admission.count([chunk])
    assert not admission.first_lookup("r1")  # (the caller counts nothing)
    assert not admission.commit(chunk, None, None)


def test_the_continuation_of_a_reused_prefix_is_admitted_whole() -> None:
    """A conversation's next turn: its prefix was looked up before, so the new chunks after it
    are written, each admitted because the one before it was."""
    admission = Admission[None]("reuse")
    prefix = [key(f"turn1/{c}") for c in range(4)]
    for request in ("turn 1", "turn 2"):
        admission.first_lookup(request)
        admission.count(prefix)
    tail = [key(f"turn2/{c}") for c in range(6)]
    admission.count(tail)
    parent = prefix[-1]
    for chunk in tail:
        assert admission.commit(chunk, parent, None)
        parent = chunk
    assert admission.admitted == 6


def test_a_refused_chunk_used_again_is_admitted_after_its_refused_ancestors() -> None:
    admission = Admission[str]("reuse")
    chain = [key(f"c{i}") for i in range(5)]
    admission.first_lookup("r1")
    admission.count(chain)
    parent = None
    for chunk in chain:
        assert not admission.commit(chunk, parent, f"value of {chunk.hex()[-4:]}")
        parent = chain[0] if chunk == chain[0] else chunk
    # A lookup hits the first three in L1 (prompt order): they are written, parents first.
    used = admission.used(chain[:3])
    assert [chunk for chunk, _ in used] == chain[:3]
    assert used[0][1] == f"value of {chain[0].hex()[-4:]}"
    # A store finds the last one in L1: its refused parent comes first.
    assert [chunk for chunk, _ in admission.used([chain[4]])] == [chain[3], chain[4]]
    assert admission.used(chain) == []  # (each once)
    assert (admission.refused, admission.admitted_later, admission.waiting) == (5, 5, 0)


def test_refused_chunks_are_remembered_within_a_bound() -> None:
    admission = Admission[None]("reuse", refused=100)
    keys = [key(f"c{i}") for i in range(300)]
    for chunk in keys:
        admission.commit(chunk, None, None)
    assert admission.waiting == 100
    assert admission.used(keys[:200]) == []  # (the oldest were forgotten)
    assert [chunk for chunk, _ in admission.used(keys[200:])] == keys[200:]


def test_chunks_seen_once_are_written_while_enough_of_them_come_back() -> None:
    """A workload of pairs (each prompt asked twice, the second time after L1 dropped it):
    once 1 in RETURNS of the first sightings came back, a chunk seen once is admitted too."""
    admission = Admission[None]("reuse")
    first = [key(f"first {i}") for i in range(1_000)]
    admission.first_lookup("firsts")
    admission.count(first)
    assert not admission.commit(key("new 0"), None, None)
    admission.first_lookup("returns")
    admission.count(first[: len(first) // RETURNS + 1])  # (missed in L1 again)
    assert admission.returning
    assert admission.commit(key("new 1"), None, None)
    # The chunk refused before is caught up with, BACKLOG per commit (oldest first).
    assert admission.backlog() == [(key("new 0"), None)]
    assert (admission.waiting, admission.admitted_later) == (0, 1)


def test_the_backlog_is_empty_while_nothing_comes_back() -> None:
    admission = Admission[int]("reuse")
    refused = [key(f"refused {i}") for i in range(10)]
    for index, chunk in enumerate(refused):
        admission.commit(chunk, None, index)
    assert admission.backlog() == []
    admission.first_lookup("firsts")
    admission.count([key(f"first {i}") for i in range(1_000)])
    admission.first_lookup("returns")
    admission.count([key(f"first {i}") for i in range(100)])
    assert admission.backlog() == [(refused[i], i) for i in range(BACKLOG)]
    assert admission.backlog() == [(refused[i], i) for i in range(BACKLOG, 2 * BACKLOG)]


def test_the_first_refusal_is_logged_at_info_once(caplog: pytest.LogCaptureFixture) -> None:
    admission = Admission[None]("reuse")
    with caplog.at_level(logging.DEBUG, logger="kvtrio.l2"):
        for i in range(100):
            admission.commit(key(f"c{i}"), None, None, now=float(i))
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(infos) == 1
    assert "l2_admission=all" in infos[0].getMessage()
    assert len(debugs) == 1  # (a summary a minute: at t = 60 s)
    assert "100 refused" not in debugs[0].getMessage()  # (the counts then, not now)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="'all' or 'reuse'"):
        Admission[None]("auto")


def pairs_then_no_reuse(admission: Admission[None]) -> list[bool]:
    """A workload of pairs (2,000 prompts of 16 chunks, each asked again 100 prompts later,
    after L1 dropped it), then 2,000 prompts that share nothing: whether each chunk of the
    second workload was admitted at its commit, in order."""

    def request(name: str, keys: list[bytes], commit: bool) -> list[bool]:
        assert admission.first_lookup(name)
        admission.count(keys)
        out = []
        parent = None
        for chunk in keys:
            if commit:
                out.append(admission.commit(chunk, parent, None))
            admission.backlog()
            parent = chunk
        return out

    prompts = [[key(f"pair {p}/{c}") for c in range(16)] for p in range(2_000)]
    for p, keys in enumerate(prompts):
        request(f"pair {p}", keys, commit=True)
        if p >= 100:
            request(f"pair {p - 100} again", prompts[p - 100], commit=False)
    assert admission.returning
    admitted: list[bool] = []
    for p in range(2_000):
        admitted += request(f"random {p}", [key(f"random {p}/{c}") for c in range(16)], True)
    return admitted


def test_the_return_rate_forgets_a_reuse_workload_when_reuse_stops() -> None:
    """After a workload of pairs switched chunks seen once on, a workload with no reuse on the
    same server: the L2 writes fall to near zero within a bounded number of chunks (FORGET
    first sightings), not after hundreds of thousands (the halving of the whole sketch)."""
    admission = Admission[None]("reuse")
    admitted = pairs_then_no_reuse(admission)
    assert not admission.returning
    assert sum(admitted[:FORGET]) <= FORGET  # (written while the estimate forgets)
    later = admitted[FORGET:]
    # Then under 1 %: what the sketch's counters, full of the pairs' second sightings until
    # its next halving, mistake for a chunk seen twice (0.1 % of chunks, each admitting the
    # rest of its prompt after it; the test measures 0.8 %).
    assert sum(later) <= len(later) // 100
    assert sum(admitted) < len(admitted) // 3
