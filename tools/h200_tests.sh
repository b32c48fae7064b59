#!/usr/bin/env bash
# The GPU exactness tests (issue 52 requirement 6) on a lent machine, whose image has torch, triton,
# transformers and pytest but no package index: the wheels the suite imports beyond those (hypothesis,
# sortedcontainers, attrs, pytest-benchmark, py-cpuinfo) are carried in WHEELS (default .gl/), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .gl \
#     hypothesis sortedcontainers attrs pytest-benchmark py-cpuinfo
# Usage there: bash tools/h200_tests.sh [SECONDS] [pytest arguments]   (default: the five GPU kernel and
# engine files below, also when the arguments name no test path, 300 s); the installed wheels stay in
# /tmp/testsite while the machine is warm.
set -euo pipefail
site=/tmp/testsite wheels=${WHEELS:-.gl}
limit=${1:-300}; shift || true
[ -f "$site/.installed" ] || { python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl \
  && touch "$site/.installed"; }
gpu_files=(tests/test_engine_overlap.py tests/test_triton_kernels.py tests/test_triton_sampling.py
  tests/test_kernel_probe.py tests/test_engine.py)
[ $# -gt 0 ] || set -- -k "not interpreter"
# options alone (`-k ...`) select among the five files: without a path pytest would run the whole suite
paths=0; for a in "$@"; do case $a in tests*|*.py|*::*) paths=1 ;; esac; done
[ $paths = 1 ] || set -- "${gpu_files[@]}" "$@"
PYTHONPATH="$site:$PWD" timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@"
