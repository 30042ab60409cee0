#!/usr/bin/env bash
# Every GPU check of kvtrio in one command, offline, on a machine with an NVIDIA GPU.
#
#   tools/gpu-check.sh [--dry-run]
#
# Needs: this checkout with wheelhouse/ built by tools/gpu-wheelhouse.sh PYVER (PYVER = the GPU
# machine's Python), and on the machine: nvidia-smi, nvcc, a C++ compiler, Python with torch
# (CUDA build), numpy, msgpack, attrs, xxhash, prometheus-client, rich and pytest. No network.
#
# Steps (each fails loudly, naming what is missing, and stops the run; a failed test does not):
#   preflight  the machine's Python, packages, GPU, driver, nvcc, C++ compiler
#   venv       a venv that sees the machine's packages (--system-site-packages)
#   install    kvtrio and what it needs, from wheelhouse/ only (pip --no-index)
#   imports    everything the next steps import, and the ninja command
#   build      the CUDA extension (torch.utils.cpp_extension; cached in ~/.cache/kvtrio)
#   tests      every GPU test (the ones that skip without a GPU): see GPU_TESTS in gpu_check.py
#   bench-*    the benches of tools/gpu_benches.py, each with its own time limit: the chunk-size
#              sweep (compiled kernels, mapped and staged; torch fallback), the end-to-end bench
#              through a real server, the prefill-vs-retrieve comparison
# then one summary (tests passed/failed, bench rows with their ratio to raw cudaMemcpy, the GPU,
# driver, torch and CUDA versions, each step's time) to $OUT/gpu-check-<time>.txt if OUT is set,
# else to stdout. Exit status 0 only if every step passed and no test failed. A failed bench is
# recorded and the next bench still runs (they measure independent things).
#
# --dry-run (for machines without a GPU, and CI): the same steps with the GPU hidden
# (CUDA_VISIBLE_DEVICES=""): the install is checked in full, the GPU is not required, the build
# is skipped, every GPU test must be collected and skip for want of a GPU, and the bench must
# refuse to run.
#
# Environment: PYTHON (default python3): the machine's Python; WHEELHOUSE (default
# <checkout>/wheelhouse); VENV (default <checkout>/.gpu-venv, made anew); OUT (see above).

# The steps are functions called through run(), which shellcheck cannot follow.
# shellcheck disable=SC2317,SC2329
set -euo pipefail

dry_run=()
case "${1:-}" in
    --dry-run) dry_run=(--dry-run) ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheelhouse=${WHEELHOUSE:-$root/wheelhouse}
venv=${VENV:-$root/.gpu-venv}
# A first build takes one to three minutes; past this, something is wrong (the other steps'
# children have their own limits in gpu_check.py).
build_timeout=${BUILD_TIMEOUT:-420}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    state=$OUT/gpu-check-$stamp.logs
    report=$OUT/gpu-check-$stamp.txt
else
    state=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-$stamp.XXXX")
    report=
fi
mkdir -p "$state"
helper=$root/tools/gpu_check.py
if [[ ${#dry_run[@]} -gt 0 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # hide any GPU: the dry run checks the no-GPU paths
else
    unset KVTRIO_NO_EXT  # the run tests the compiled kernels and the fallback, each on purpose
fi

finish() {
    local status=0
    if ! command -v "$venv_python" >/dev/null; then  # no Python at all: the bare step list
        echo "gpu-check: FAILED; no Python to write the summary with. Steps:" >&2
        cat "$state/steps.tsv" >&2
        exit 1
    fi
    if [[ -n $report ]]; then
        "$venv_python" "$helper" summary --state "$state" "${dry_run[@]}" --out "$report" \
            || status=$?
        echo "gpu-check: summary in $report"
        cat "$report"
    else
        "$venv_python" "$helper" summary --state "$state" "${dry_run[@]}" || status=$?
    fi
    exit "$status"
}

# run NAME COMMAND...: one step, timed and recorded in steps.tsv; stops the run if it fails.
run() {
    local name=$1 start status=0
    shift
    echo "gpu-check: $name ..." >&2
    start=$(date +%s.%N)
    "$@" || status=$?
    local seconds
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [[ $status -ne 0 ]]; then
        local why="exit $status"
        [[ $status -eq 124 ]] && why="timed out"
        printf '%s\tFAILED\t%s\t%s: see the message above\n' "$name" "$seconds" "$why" \
            >>"$state/steps.tsv"
        echo "gpu-check: FAILED at step '$name' ($why); the run stops here" >&2
        finish
    fi
    printf '%s\tok\t%s\t\n' "$name" "$seconds" >>"$state/steps.tsv"
}

# run_soft NAME COMMAND...: as run, but a failure is recorded and the run goes on.
run_soft() {
    local name=$1 start status=0
    shift
    echo "gpu-check: $name ..." >&2
    start=$(date +%s.%N)
    "$@" || status=$?
    local seconds
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [[ $status -ne 0 ]]; then
        printf '%s\tFAILED\t%s\texit %s: see the message above\n' "$name" "$seconds" "$status" \
            >>"$state/steps.tsv"
        echo "gpu-check: step '$name' FAILED (exit $status); going on" >&2
        return 0
    fi
    printf '%s\tok\t%s\t\n' "$name" "$seconds" >>"$state/steps.tsv"
}

# The summary needs some Python: the machine's until the venv exists.
venv_python=$python

preflight() {
    command -v "$python" >/dev/null || { echo "no Python: $python (set PYTHON)" >&2; return 1; }
    compgen -G "$wheelhouse/kvtrio-*.whl" >/dev/null || {
        echo "no kvtrio wheel in $wheelhouse: run tools/gpu-wheelhouse.sh PYVER with network" >&2
        return 1
    }
    "$python" "$helper" preflight --state "$state" "${dry_run[@]}"
}

make_venv() {
    rm -rf "$venv"
    "$python" -m venv --system-site-packages "$venv" || {
        echo "cannot create a venv with $python (Debian: the python3-venv package)" >&2
        return 1
    }
    # --system-site-packages shows the base interpreter's packages only: if the machine's Python
    # is itself a venv (or a virtualenv), add its site-packages too, after the venv's own.
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$python" -c 'import site, sys; print("\n".join(site.getsitepackages()))' \
        >"$site/_kvtrio_gpu_check_parent.pth"
    venv_python=$venv/bin/python
}

install() {
    # pip keeps the machine's packages that satisfy kvtrio; the rest come from the wheelhouse
    # only: no index, and no pip configuration (files or PIP_* variables) adding other sources.
    PIP_CONFIG_FILE=/dev/null "$venv_python" -m pip --isolated install --quiet --no-index \
        --disable-pip-version-check --find-links "$wheelhouse" \
        kvtrio pytest-trio ninja setuptools
}

run preflight preflight
run venv make_venv
export PATH=$venv/bin:$PATH  # ninja for torch's extension build
run install install
run imports "$venv_python" "$helper" imports --state "$state"
cd "$root"
run build timeout "$build_timeout" "$venv_python" "$helper" build --state "$state" "${dry_run[@]}"
run tests "$venv_python" "$helper" tests --state "$state" "${dry_run[@]}"
for bench in transfer-extension transfer-torch e2e prefill; do
    run_soft "bench-$bench" "$venv_python" "$helper" bench --name "$bench" --state "$state" \
        "${dry_run[@]}"
done
finish
