#!/usr/bin/env bash
# Fetch the SonicMoE package set that ran on the H200 (../shared/gpu-notes.md), plus the `kernels` package
# (the GPU machine has none), unzip every wheel into one folder and pack it as .carry/sonicmoe.tar.xz.
#
# Run from anywhere; writes under the repository root (both folders are git-ignored):
#   .whl/sonicmoe/        the downloaded wheels (not committed)
#   .carry/sonicmoe.tar.xz  one xz archive of the unzipped site folder, small enough to copy to a GPU node beside the repo
#
# On the GPU machine: mkdir -p /tmp/sonicmoe && tar -xJf .carry/sonicmoe.tar.xz -C /tmp/sonicmoe, then
# benchmarks/sonicmoe_gpu.py --site /tmp/sonicmoe/site (it calls site.addsitedir: cutlass-dsl needs its .pth).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/.whl/sonicmoe"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

# The set seen working on torch 2.11 + CUDA 13.0 + Python 3.12 (gpu-notes.md), and kernels for the local
# kernel loader. kernels' own needs (huggingface-hub >= 1.10, packaging, pyyaml) are expected on the
# machine; sigstore and tomlkit are only used by its CLI, not by get_kernel/get_local_kernel.
PACKAGES=(
  "sonic-moe==0.1.2.post1"
  "nvidia-cutlass-dsl==4.4.2"
  "nvidia-cutlass-dsl-libs-base==4.4.2"
  "quack-kernels==0.3.11"
  "apache-tvm-ffi==0.1.15.post2"
  "torch-c-dlpack-ext==0.1.5"
  "einops==0.8.2"
  "kernels==0.17.2"
)

mkdir -p "$WHEELS" "$ROOT/.carry"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WHEELS" "${PACKAGES[@]}"

mkdir -p "$STAGE/site"
for wheel in "$WHEELS"/*.whl; do
  "$PYTHON" -m zipfile -e "$wheel" "$STAGE/site"
done
# Bytecode compiled here would be for another interpreter; leave it out.
find "$STAGE/site" -name '__pycache__' -type d -prune -exec rm -rf {} +

XZ_OPT=-9 tar -C "$STAGE" -cJf "$ROOT/.carry/sonicmoe.tar.xz" site
ls -l "$WHEELS"
du -h "$ROOT/.carry/sonicmoe.tar.xz"
