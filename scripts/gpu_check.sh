#!/usr/bin/env bash
# GPU checks for a lent device machine (one run, < 8 minutes): the Triton kernels on CUDA against
# their references, compiled rounds as CUDA graphs vs eager (tests/test_cuda.py), and the
# verification benchmark with Triton.
# Usage on the device: bash scripts/gpu_check.sh  (writes results under ${OUT:-gpu_out})
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}; mkdir -p "$out"
python -m pip install -q -e ".[dev]" --no-deps 2>&1 | tail -1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/env.txt"
timeout 300 python -m pytest -q tests/test_cuda.py tests/test_kernels_triton.py tests/test_verify_exact.py 2>&1 | tail -15 | tee "$out/tests.txt"
timeout 200 python benchmarks/verify_bench.py --device cuda --repeats 10 --no-compile --out "$out/verify_cuda.json" 2>&1 | tail -30 | tee "$out/verify_bench.txt"
