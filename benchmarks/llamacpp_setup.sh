#!/usr/bin/env bash
# The llama.cpp peer (llama-cpp-python) in its own virtual environment, built from its sdist.
#
#   bash benchmarks/llamacpp_setup.sh [VENV]     # default VENV: ~/.cache/specgraph/llamacpp-venv
#
# Downloads the llama-cpp-python sdist from PyPI, unpacks it under VENV/src (it carries llama.cpp
# and its HF -> GGUF converter, vendor/llama.cpp/convert_hf_to_gguf.py), builds and installs it
# for this CPU (cmake and g++; about 15 minutes on 2 cores), installs what the converter needs
# (its own gguf-py, torch pinned to the CPU build, a transformers 5 that reads the tokenizer files
# specgraph writes), and
# prints the venv's python, which benchmarks/stream_bench.py --llamacpp-python takes.
set -euo pipefail
VENV="${1:-$HOME/.cache/specgraph/llamacpp-venv}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
SRC="$VENV/src/llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
  mkdir -p "$VENV/src"
  "$VENV/bin/python" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$VENV/src"
  tar -xzf "$VENV/src/llama_cpp_python-$VERSION.tar.gz" -C "$VENV/src"
fi
# torch first and pinned (the converter imports it): an unpinned resolution pulls a CUDA build
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "$SRC/vendor/llama.cpp/gguf-py" "numpy<2.3" "sentencepiece>=0.1.98,<0.3" \
  "protobuf>=4.21,<5" "transformers>=5.17,<6"
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "building llama-cpp-python $VERSION from source (about 15 minutes) ..." >&2
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/python" -m pip install -q "$SRC"
fi
"$VENV/bin/python" -c "import llama_cpp, torch, transformers; print('llama_cpp', llama_cpp.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
echo "$VENV/bin/python"
