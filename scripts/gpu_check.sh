#!/usr/bin/env bash
# The prepared GPU check (issue 29): one command, well under 8 minutes, on a GPU machine
# lent for a few minutes with no network. It installs what the machine lacks from the
# carried wheels, installs asyncrl from this tree (--no-deps: the machine's torch and
# transformers stay as they are), then runs benchmarks/gpu_check.py, which writes
# $OUT/gpu_check.json (figures, rewritten after every check) and $OUT/gpu_check.log.
#
#   bash scripts/gpu_wheels.sh                      # here, once: the wheel folder .gpu-wheels/
#   OUT=DIR bash scripts/gpu_check.sh [ARGS]        # there; ARGS go to gpu_check.py
#                                                   # (--budget-s, --only NAME, --no-rehearsal)
#
# Environment: OUT (default runs/gpu-check), GPU_WHEELS (default .gpu-wheels), PYTHON
# (default python3: on the GPU machines, /opt/torch/.venv/bin/python3 with torch
# 2.11.0+cu130 and transformers 5.17.0; their package list is
# tests/unit/run/gpu_machine_packages.txt).
#
# Nothing is installed into the machine's Python: the wheels and asyncrl go to a fresh
# folder on PYTHONPATH, and PYTHONSAFEPATH=1 keeps this tree's asyncrl/ folder (which
# lacks asyncrl.learner and the other mapped packages) off sys.path, so every process
# imports the installed copy of this very tree.
#
# Rehearsed on a CPU machine with a Python 3.12 virtual environment that holds what the
# GPU machines have that asyncrl needs, and nothing else (made once, by hand; 5 GB):
#   /root/.pyenv/versions/3.12.1/bin/python3 -m venv /work/gpu-rehearsal-venv
#   /work/gpu-rehearsal-venv/bin/pip install torch==2.11.0        # PyPI's CUDA build; runs on CPU
#   /work/gpu-rehearsal-venv/bin/pip install transformers==5.17.0 numpy==2.5.2 \
#       accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2 huggingface_hub==1.33.0 \
#       msgpack uvloop pyarrow pytest pytest-timeout psutil rich pyyaml
#   /work/gpu-rehearsal-venv/bin/pip install --no-deps peft==0.21.2   # preinstalled there too
#   # transformers' typer pulls in pydantic, which the GPU machines lack: out again, so that
#   # it comes only from the carried wheels, as there
#   /work/gpu-rehearsal-venv/bin/pip uninstall -y pydantic pydantic-core annotated-types \
#       typing-inspection
#   PATH=/work/gpu-rehearsal-venv/bin:$PATH OUT=/tmp/gpu-rehearsal-out bash scripts/gpu_check.sh
# There every CUDA-only check is reported as skipped, by name, and rehearsed at a toy size
# on the CPU (docs/benchmarks.md, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu-check}"
wheels="${GPU_WHEELS:-.gpu-wheels}"
python="${PYTHON:-python3}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
site="$(mktemp -d /tmp/asyncrl-gpu-check.XXXXXX)"
trap 'rm -rf "$site"' EXIT
started=$SECONDS

install() {
  local pip=("$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
  echo "== $(date -Is) $(command -v "$python"): $("$python" --version 2>&1)"
  "$python" -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|numpy|setuptools|typing.extensions) '
  compgen -G "$wheels/*.whl" >/dev/null || { echo "no wheels in $wheels: run scripts/gpu_wheels.sh"; return 1; }
  "${pip[@]}" --target "$site/lib" "$wheels"/*.whl || return 1
  # asyncrl from a copy of the tree (its build writes no files here), with the setuptools
  # it was rehearsed with
  "${pip[@]}" --target "$site/build" "$wheels"/build/*.whl || return 1
  mkdir -p "$site/src"
  cp -r asyncrl learner generators buffer setup.py pyproject.toml README.md "$site/src/"
  PYTHONPATH="$site/build" "${pip[@]}" --no-build-isolation --upgrade --target "$site/lib" \
    "$site/src" || return 1
}

setup=()
if ! install >>"$log" 2>&1; then
  echo "setup failed; the end of $log:"
  tail -n 20 "$log"
  setup=(--setup-failed "installing the wheels or asyncrl failed (gpu_check.log)")
fi
export PYTHONPATH="$site/lib" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
"$python" benchmarks/gpu_check.py --out "$out" --setup-s "$((SECONDS - started))" \
  "${setup[@]}" "$@"
