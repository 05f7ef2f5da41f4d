#!/usr/bin/env bash
# Fetch a DeepGEMM build that loads on a CUDA 13 / torch 2.11 GPU node without internet, and pack it as
# .carry/deepgemm.tar.xz (git-ignored) for benchmarks/deepgemm_gpu.py.
#
# Where it comes from: the hub kernel (kernels-community/deep-gemm) needs the Hugging Face Hub, and PyPI's
# `deep-gemm` 1.0.0 is a 19 kB sdist without its CUDA headers. `sgl-deep-gemm` (SGLang's DeepGEMM build,
# import name `deep_gemm`) is complete: Python wrappers with the hub kernel's API names, the JIT headers with
# CuTe/CUTLASS, and a `_C.so` built for CUDA 13 (releases up to 0.2.2 on apache-tvm-ffi). A prebuilt
# extension still reads tensors through the inline code of the torch headers it was built with, so whether a
# release works depends on the node's torch: on torch 2.11, 0.1.5 runs while 0.1.5.post3 and 0.1.6 fail at the
# first call, and so does the DeepGEMM inside sgl-kernel 0.3.21 (a torch 2.9-era build). The folder keeps
# several releases; deepgemm_gpu.py --smoke finds one that runs. DeepGEMM's JIT calls the node's nvcc.
#
#   .whl/deepgemm/            the downloaded wheels (not committed)
#   .carry/deepgemm.tar.xz    site/tvm_ffi + site/deep_gemm-<version>/deep_gemm per release (~5 MB in all)
#
# On the GPU machine: mkdir -p /tmp/dg && tar -xJf .carry/deepgemm.tar.xz -C /tmp/dg &&
#   python3 benchmarks/deepgemm_gpu.py --site /tmp/dg/site --package /tmp/dg/site/deep_gemm-0.1.6 --out "$OUT"
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/.whl/deepgemm"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

mkdir -p "$WHEELS" "$ROOT/.carry"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
  -d "$WHEELS" "apache-tvm-ffi==0.1.11"
# One folder per release tried (site/deep_gemm-<version>/deep_gemm): which one's _C.so works with the node's
# torch is found on the node (deepgemm_gpu.py --smoke).
VERSIONS=(${DEEPGEMM_VERSIONS:-0.1.5.post3 0.1.6 0.1.5 0.1.4.post1})
mkdir -p "$STAGE/site"
"$PYTHON" -m zipfile -e "$WHEELS"/apache_tvm_ffi-*.whl "$STAGE/site"
for version in "${VERSIONS[@]}"; do
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d "$WHEELS/sgl-deep-gemm-$version" "sgl-deep-gemm==$version"
  "$PYTHON" -m zipfile -e "$WHEELS/sgl-deep-gemm-$version"/*.whl "$STAGE/site/deep_gemm-$version"
  rm -rf "$STAGE/site/deep_gemm-$version"/*.dist-info
done
find "$STAGE/site" -name '__pycache__' -type d -prune -exec rm -rf {} +
XZ_OPT="-9 -T0" tar -C "$STAGE" -cJf "$ROOT/.carry/deepgemm.tar.xz" site
du -h "$ROOT/.carry/deepgemm.tar.xz"
