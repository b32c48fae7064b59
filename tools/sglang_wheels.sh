#!/usr/bin/env bash
# SGLang 0.5.17 for the lent H200 (Python 3.12, torch 2.11.0+cu130, no package index), as xz parts of
# at most 47 MiB that travel one per device call (a call carries at most 64 MiB).
#
# Why 0.5.17: the newest SGLang whose pins match the image's torch (0.5.17 pins torch==2.11.0,
# sglang-kernel==0.4.5, flashinfer-python==0.6.15.post1; 0.5.18 and later pin torch 2.13/2.14).
# Everything is downloaded --no-deps for the machine's platform and installed here into one
# site directory (pip --target with the H200's tags), then stripped, tarred, xz'd and split:
#   OUT/sg_aa, OUT/sg_ab, ...   (on the device: cat sg_* | xz -d | tar -x -C /tmp/sgsite)
#
# Stripped (never loaded on parity's path: a dense or MoE bf16 model on one Hopper GPU, served with
# --attention-backend triton, which tools/h200_sglang.sh passes):
#   sgl_kernel/flash_ops.abi3.so      1.12 GB: FlashAttention 2/3, loaded only by the fa3/fa4
#                                     attention backends; sgl_kernel/flash_attn.py imports it in a
#                                     try block, so `import sgl_kernel` works without it
#   sgl_kernel/sm100/common_ops*.so   the Blackwell build; sgl_kernel loads sm90/ on compute
#                                     capability 9.0 (load_utils._load_architecture_specific_ops)
#   sgl_kernel/flashmla_ops.abi3.so   FlashMLA (DeepSeek's MLA attention), imported in a try block
#   sgl_kernel/infllm_ops*.so         InfLLM-V2 sparse attention (MiniCPM), loaded on first call
# The image already holds torch, triton, transformers, numpy, aiohttp, requests, psutil, einops,
# safetensors, huggingface_hub, uvloop, pillow, and the rest of KINDS.md's list: not carried.
# The dependency list below is what `import sglang.launch_server` and a server start on a dense
# and a MoE Qwen3 model import (found by importing in a Python 3.12 venv here and on the H200).
set -euo pipefail
out=${1:?usage: sglang_wheels.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"; w=${SGLANG_WHEELS_WORKDIR:-$(mktemp -d)}; site="$w/site"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
pkgs=(sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
      "apache-tvm-ffi==0.1.11" nvidia-cudnn-frontend nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0
      cuda-tile nccl4py
      "fastapi<0.137" starlette "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection
      uvicorn python-multipart "openai==2.6.1" jiter distro sniffio "openai-harmony==0.0.4" orjson msgspec pyzmq
      pybase64 partial-json-parser setproctitle "xgrammar==0.2.1" "llguidance<2,>=1.7.6" interegular
      compressed-tensors gguf zstandard watchfiles dill "torchao==0.17.0" torch_memory_saver
      blobfile pycryptodomex soundfile cffi pycparser loguru
      ipython traitlets decorator jedi parso matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth stack_data
      asttokens executing pure_eval ipython-pygments-lexers
      jsonschema jsonschema-specifications referencing rpds-py mistral_common pycountry pydantic-extra-types
      )
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$w/dl" "${pkgs[@]}"
"$py" -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$site" "$w"/dl/*
# SGLang 0.5.17 pins transformers 5.12.1: the image's 5.17 fails its import ("'qwen3_asr' is already used
# by a Transformers config"), and 5.12.1 refuses the image's tokenizers 0.23.2 (it wants <=0.23.0). Both
# go in tf/, which only the server's Python sees (the wrapper tools/h200_sglang.sh writes,
# PARITY_SGLANG_PYTHON), so parity's side keeps the image's.
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$w/tf" transformers==5.12.1 tokenizers==0.22.2
"$py" -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$site/tf" "$w"/tf/*
rm -f "$site"/sgl_kernel/flash_ops.abi3.so "$site"/sgl_kernel/flashmla_ops.abi3.so "$site"/sgl_kernel/infllm_ops*.so
rm -rf "$site"/sgl_kernel/sm100 "$site"/bin "$site"/tf/bin
# Python packages the server never imports here (a CPU start of this site with -X importtime, and the
# H200 runs, loaded none of them): CUTLASS's Python DSL (flashinfer's Blackwell/FP4 kernels; it also
# needs its .pth file, which PYTHONPATH directories do not read), jedi/parso (IPython's completer),
# nccl4py (multi-GPU), cuda-tile.
rm -rf "$site"/nvidia_cutlass_dsl* "$site"/jedi* "$site"/parso* "$site"/nccl "$site"/nccl4py* "$site"/cuda_tile* \
       "$site"/cuda/tile "$site"/cutile_cache; rmdir "$site"/cuda 2>/dev/null || true
tar -C "$site" -cf - . | xz -T0 -${SGLANG_XZ_LEVEL:-3} > "$w/sglang.tar.xz"
split -b 47m "$w/sglang.tar.xz" "$out/sg_"
ls -la "$out"; du -sh "$site"
[ -n "${SGLANG_WHEELS_WORKDIR:-}" ] || rm -rf "$w"
