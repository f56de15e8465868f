"""Where the serving engine's time goes: N requests of the stream prompts submitted at once to a
`ServingEngine` in this process (no HTTP), stepped until all finish, with the seconds of each
scheduler phase (prefill, drafting, round graphs, delivery, retiring rows) and the measured cost of
a round per (batch bucket, depth) at the smallest attended width.

    python benchmarks/serve_profile.py --requests 16 --out r.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import cpu_model, git_commit  # noqa: E402
from stream_prompts import PROMPTS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--speculation", default="auto", help="auto, or a fixed depth (0 = off)")
    ap.add_argument("--prefix-cache-mb", type=int, default=512, help="the engine's prompt-prefix pool (0: off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import specgraph
    from specgraph.models import load_model
    from specgraph.serving import ServeRequest, ServingEngine
    from specgraph.serving.depth import FixedServingDepth

    model, tok = load_model("default")
    t0 = time.perf_counter()
    fast = specgraph.compile(model, "ngram", max_batch_size=args.max_batch_size, max_seq_len=2048, modes=("greedy",),
                             progress=False)
    startup = time.perf_counter() - t0
    policy = None if args.speculation == "auto" else FixedServingDepth(fast.chain_depths(), int(args.speculation))
    engine = ServingEngine(fast, policy=policy, prefix_cache_bytes=args.prefix_cache_mb << 20)
    costs = engine.warmup(("greedy",), progress=False)["costs"]

    phases = collections.Counter()

    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - t
        return run

    for name in ("_prefill", "_propose", "_run_lane", "_deliver", "_retire", "_round"):
        setattr(engine, name, timed(name.strip("_"), getattr(engine, name)))

    def ids(text):
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]

    reqs = [ServeRequest(ids(PROMPTS[i % len(PROMPTS)][1]), args.max_tokens) for i in range(args.requests)]
    finished = []
    for r in reqs:
        engine.submit(r, lambda ev: ev.finish is not None and finished.append(ev.finish))
    t0 = time.perf_counter()
    while len(finished) < len(reqs):
        engine.step()
    wall = time.perf_counter() - t0
    st = engine.stats
    result = {
        "commit": git_commit(), "cpu": cpu_model(),
        "requests": args.requests, "prompt_tokens": sum(len(r.prompt) for r in reqs), "tokens": st.tokens,
        "prefill_tokens": st.prefill_tokens, "prefix_cache_tokens": st.prefix_tokens,
        "startup_s": round(startup, 1), "wall_s": round(wall, 2), "tokens_per_s": round(st.tokens / wall, 1),
        "rounds": st.rounds, "depth_rounds": dict(st.depth_rounds),
        "mean_decoding_rows": round(st.occupancy_sum / max(st.rounds, 1), 2),
        "phase_seconds": {k: round(v, 2) for k, v in phases.items()},
        "round_cost_ms_at_min_width": {f"b{b}_k{d}": round(1000 * s, 1) for (b, d), s in costs.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
