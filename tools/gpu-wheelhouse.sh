#!/usr/bin/env bash
# Build wheelhouse/ for an offline GPU machine: every wheel tools/gpu-check.sh installs there.
#
#   tools/gpu-wheelhouse.sh PYVER        # e.g. 3.12; run with network, from anywhere
#
# The GPU machine already has Python PYVER with torch (CUDA build), numpy, msgpack, attrs, xxhash,
# prometheus-client, rich and pytest. This downloads, for CPython PYVER on Linux x86-64
# (manylinux2014), kvtrio's own wheel (built from this checkout) and its whole dependency tree
# (trio, pyzmq, cattrs, hypercorn, structlog, ...), pytest-trio, and ninja and setuptools (torch
# needs both to build the CUDA extension), minus numpy: 16 MiB, and the machine's torch was built
# against the machine's numpy. The small packages of the list above are carried too, so an old
# preinstalled version of one (attrs < 24.1, say) does not stop the offline install; pip keeps the
# preinstalled ones that satisfy kvtrio. hypothesis is not carried: no GPU test uses it.
#
# Environment: PYTHON (default python3) runs pip (>= 23, any version); WHEELHOUSE (default
# <checkout>/wheelhouse) is emptied first. Prints the wheels and their total size, and fails if
# that exceeds LIMIT_MIB (default 40; the checkout may carry 64 MiB in all).
set -euo pipefail

usage() { echo "usage: $0 PYVER   (e.g. 3.12)" >&2; exit 2; }
[[ $# -eq 1 ]] || usage
pyver=$1
[[ $pyver =~ ^3\.[0-9]+$ ]] || usage

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheelhouse=${WHEELHOUSE:-$root/wheelhouse}
limit_mib=${LIMIT_MIB:-40}
# Beyond kvtrio's own dependencies: what the GPU tests and the extension build need.
extra=(pytest-trio ninja setuptools)
# Preinstalled there and not carried (see above).
not_carried=(numpy)

fail() { echo "gpu-wheelhouse: $*" >&2; exit 1; }
command -v "$python" >/dev/null || fail "no Python to run pip: $python (set PYTHON)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf "$wheelhouse"
mkdir -p "$wheelhouse"
echo "gpu-wheelhouse: building kvtrio's wheel from $root"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheelhouse" "$root" \
    || fail "building kvtrio's wheel failed"
kvtrio_wheel=$(ls "$wheelhouse"/kvtrio-*.whl)

# Resolve for the target (Python, platform) without installing, then download exactly that set.
target=(--only-binary=:all: --implementation cp --python-version "$pyver"
        --platform manylinux2014_x86_64)
echo "gpu-wheelhouse: resolving kvtrio ${extra[*]} for CPython $pyver, manylinux2014_x86_64"
"$python" -m pip install --quiet --dry-run --ignore-installed --target "$work/target" \
    --report "$work/report.json" "${target[@]}" "$kvtrio_wheel" "${extra[@]}" \
    || fail "resolving the dependencies for Python $pyver failed (see pip's message above)"
"$python" - "$work/report.json" "${not_carried[@]}" >"$work/pins.txt" <<'EOF'
import json, re, sys

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

report, skip = sys.argv[1], {norm(n) for n in sys.argv[2:]}
for item in json.load(open(report))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if norm(name) not in skip | {"kvtrio"}:
        print(f"{name}=={version}")
EOF
echo "gpu-wheelhouse: downloading $(wc -l <"$work/pins.txt") wheels"
"$python" -m pip download --quiet --no-deps --dest "$wheelhouse" "${target[@]}" \
    -r "$work/pins.txt" || fail "downloading the wheels failed (see pip's message above)"

ls -1 "$wheelhouse"
bytes=$(du -cb "$wheelhouse"/*.whl | tail -n 1 | cut -f 1)
mib=$(( (bytes + 1048575) / 1048576 ))
count=$(find "$wheelhouse" -name '*.whl' | wc -l)
echo "gpu-wheelhouse: $count wheels, $bytes bytes (${mib} MiB) in $wheelhouse"
(( bytes <= limit_mib * 1048576 )) || fail "the wheelhouse is over ${limit_mib} MiB"
