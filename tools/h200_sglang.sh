#!/usr/bin/env bash
# SGLang 0.5.17 on a machine without a package index (the lent H200s), from xz parts carried one per call.
#
# Here, once: bash tools/sglang_wheels.sh .sglang-wheels   (sg_aa, sg_ab, ...: 47 MiB each at most)
# There, each call carries one part (a call carries at most 64 MiB) and stages it; the machine keeps
# /tmp while it is warm (it goes back after ~30 s idle, so the calls go back to back):
#   bash tools/h200_sglang.sh stage          copies the carried parts ($SGLANG_PARTS_FROM, default
#                                            .sglang-wheels) to /tmp/sgparts
#   bash tools/h200_sglang.sh install        unpacks them into /tmp/sgsite (its own site directory:
#                                            SGLang's flashinfer 0.6.15 is not vLLM's 0.6.12 in
#                                            /tmp/site) and writes /tmp/sgsite/python, the server's
#                                            Python: the image's python3 with /tmp/sgsite/tf (SGLang's
#                                            pinned transformers 5.12.1) and /tmp/sgsite first on its
#                                            path; parity's own process keeps the image's packages
#   bash tools/h200_sglang.sh run ARGS       all in one: stage, install once every part is there
#                                            (SGLANG_PARTS, default 3), then python3 -m
#                                            benchmarks.gpu_sglang ARGS with PARITY_SGLANG_PYTHON set
#                                            (it resumes: sections done on this machine are skipped)
# On a host with a package index none of this is needed: `pip install sglang`.
set -euo pipefail
parts=/tmp/sgparts site=/tmp/sgsite from=${SGLANG_PARTS_FROM:-.sglang-wheels}
case "${1:-}" in
  stage)
    mkdir -p "$parts"
    for f in "$from"/sg_*; do [ -f "$f" ] && cp "$f" "$parts/"; done
    ls -la "$parts" ;;
  install)
    mkdir -p "$site"
    cat "$parts"/sg_* | xz -d | tar -x -C "$site"
    printf '#!/bin/sh\nPYTHONPATH=%s/tf:%s${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' "$site" "$site" \
      > "$site/python"
    chmod +x "$site/python"
    "$site/python" -c "import sglang, sgl_kernel; print('sglang', sglang.__version__)" ;;
  run)
    shift
    bash "$0" stage >/dev/null
    if [ ! -f "$site/.installed" ]; then
      n=$(ls "$parts" | grep -c '^sg_' || true)
      [ "$n" -ge "${SGLANG_PARTS:-3}" ] || { echo "staged $n of ${SGLANG_PARTS:-3} parts; carry the next" >&2; exit 3; }
      bash "$0" install && touch "$site/.installed"
    fi
    PARITY_SGLANG_PYTHON="$site/python" python3 -m benchmarks.gpu_sglang "$@" ;;
  *) echo "usage: $0 stage|install|run [benchmarks.gpu_sglang arguments]" >&2; exit 2 ;;
esac
