#!/usr/bin/env bash
# Make the wheel folder the GPU check carries (scripts/gpu_check.sh installs from it):
# cp312 manylinux x86_64 wheels of what asyncrl needs and the GPU machine lacks.
#   bash scripts/gpu_wheels.sh            # into .gpu-wheels/ (git-ignored)
#   bash scripts/gpu_wheels.sh DIR        # into DIR
# The GPU machine has no registry: its preinstalled packages are listed in
# tests/unit/run/gpu_machine_packages.txt, and tests/unit/run/test_gpu_check_wheels.py
# checks that every third-party module the check imports is there or below.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu-wheels}"
python="${PYTHON:-python3}"

# What the check imports that the machine lacks, and their own requirements (--no-deps:
# pip fetches nothing else). typing-extensions is preinstalled there in an unknown
# version; pydantic needs >=4.16.
RUNTIME=(
  "pyzmq==27.3.0"
  "msgspec==0.22.0"
  "pydantic==2.14.4"
  "pydantic-core==2.50.5"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
  "cryptography==50.0.2"
  "cffi==2.1.1"
  "pycparser==3.12"
)
# Builds asyncrl's wheel there (pip --no-build-isolation); kept off the checks' path.
BUILD=(
  "setuptools==78.1.1"
)

download() {
  "$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$@"
}

rm -rf "$out"
mkdir -p "$out/build"
download "$out" "${RUNTIME[@]}"
download "$out/build" "${BUILD[@]}"
du -sh "$out"
ls "$out" "$out/build"
