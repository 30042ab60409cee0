"""Where a CPU worker's kvtrio threads run: the cores the engine does not compute on."""

from __future__ import annotations

from kvtrio.integration._cores import (
    SHARED_NICE,
    frontend_advice,
    omp_env_cpus,
    worker_placement,
)


def test_kvtrio_takes_the_cores_vllm_reserves() -> None:
    placement, said = worker_placement(frozenset({0, 1, 2}), frozenset({3}), frozenset(range(4)))
    assert placement.cpus == frozenset({3})
    assert placement.nice == 0
    assert "CPUs 3" in said
    assert "CPUs 0-2" in said


def test_without_a_reservation_the_cores_nobody_computes_on() -> None:
    # VLLM_CPU_OMP_THREADS_BIND given by hand: vLLM reserves nothing, every rank's cores count
    placement, _ = worker_placement(frozenset({0, 1, 4, 5}), frozenset(), frozenset(range(8)))
    assert placement.cpus == frozenset({2, 3, 6, 7})


def test_every_core_computing_means_sharing_at_a_lower_priority() -> None:
    placement, said = worker_placement(frozenset({0, 1}), frozenset(), frozenset({0, 1}))
    assert placement.cpus is None
    assert placement.nice == SHARED_NICE
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in said


def test_unknown_cores_leave_the_threads_where_they_are() -> None:
    placement, _ = worker_placement(None)
    assert placement.cpus is None
    assert placement.nice == 0


def test_a_reserved_core_that_also_computes_is_not_taken() -> None:
    placement, _ = worker_placement(frozenset({0, 1}), frozenset({1}), frozenset({0, 1}))
    assert placement.cpus is None
    assert placement.nice == SHARED_NICE


def test_the_openmp_cores_vllm_set_for_this_worker() -> None:
    assert omp_env_cpus({"GOMP_CPU_AFFINITY": "0 1", "OMP_PLACES": "{5}"}) == {0, 1}
    assert omp_env_cpus({"GOMP_CPU_AFFINITY": "0-6:2"}) == {0, 2, 4, 6}
    kmp = "granularity=fine,explicit,proclist=[2,3,8-9]"
    assert omp_env_cpus({"KMP_AFFINITY": kmp}) == {2, 3, 8, 9}
    assert omp_env_cpus({"OMP_PLACES": "{0,1,2}"}) == {0, 1, 2}
    assert omp_env_cpus({"OMP_PLACES": "{0},{1}", "OMP_NUM_THREADS": "2"}) == {0, 1}
    assert omp_env_cpus({"OMP_NUM_THREADS": "2"}) is None


def test_an_engine_core_that_may_run_on_the_compute_cores_is_told_where_to_run() -> None:
    said = frontend_advice(frozenset({0}), frozenset(), frozenset({0, 1}), own=frozenset({0, 1}))
    assert said is not None
    assert "CPUs 0-1" in said
    assert "compute CPUs 0" in said
    assert "taskset -c 1 vllm serve" in said
    # vLLM's reserved cores first, where it has them
    said = frontend_advice(
        frozenset({0, 1}), frozenset({3}), frozenset(range(4)), own=frozenset(range(4))
    )
    assert said is not None
    assert "taskset -c 3 vllm serve" in said


def test_no_advice_where_it_runs_off_the_compute_cores_or_there_is_nowhere_else() -> None:
    # started with taskset on the spare core (bench/serve.py's --frontend-cpus spare)
    assert (
        frontend_advice(frozenset({0}), frozenset(), frozenset({0, 1}), own=frozenset({1})) is None
    )
    # every core computes
    assert (
        frontend_advice(frozenset({0, 1}), frozenset(), frozenset({0, 1}), frozenset({0, 1}))
        is None
    )
    # not a CPU engine, or its cores unknown
    assert frontend_advice(None, own=frozenset({0, 1})) is None
    assert frontend_advice(frozenset({0}), own=None) is None
