"""How much each ``weights=`` precision changes the model: NLL and top-1 agreement on fp32 text.

For each prompt of the stream (``--prompts`` of them), the fp32 model's greedy continuation
(``--tokens`` tokens, HF generate) is the text; each precision's model (``gguf_weights.model_at``:
what ``compile(weights=...)`` verifies against) scores that text teacher-forced: the mean negative
log-likelihood per continuation token, and the share of positions where its top token is the
text's. Eager forwards only (the reference math of each precision); prints a table, writes JSON.

    python benchmarks/weights_quality.py --out benchmarks/results/weights_quality_smollm2.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from specgraph import gguf_weights
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from stream_bench import chat_ids  # noqa: E402
from stream_prompts import PROMPTS  # noqa: E402
from width_profile import cpu_name  # noqa: E402


@torch.no_grad()
def score(model, texts: list[tuple[torch.Tensor, int]]) -> tuple[float, float]:
    """(mean NLL per continuation token, top-1 agreement) of ``model`` on (ids [1, T], prompt length) texts."""
    nll, agree, n = 0.0, 0, 0
    for ids, p in texts:
        logits = model(ids).logits[0, p - 1:-1].float()  # [T - p, V]: predictions of the continuation
        target = ids[0, p:]
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        agree += (logits.argmax(-1) == target).sum().item()
        n += target.numel()
    return nll / n, agree / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--weights", default="float32,bfloat16,int8,int4,native")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    texts = []
    for _, text in PROMPTS[:args.prompts]:
        ids = chat_ids(tok, text)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False,
                             eos_token_id=[], pad_token_id=tok.pad_token_id or 0)
        texts.append((out, ids.shape[1]))
    rows = []
    for w in args.weights.split(","):
        nll, top1 = score(gguf_weights.model_at(model, w), texts)
        rows.append({"weights": w, "nll": round(nll, 4), "top1_agreement": round(top1, 4)})
        print(f"{w:>10}  NLL {nll:.3f}  top-1 agreement {top1:.3f}", flush=True)
    if args.out:
        write_json(args.out, {"model": args.model, "prompts": args.prompts, "tokens": args.tokens, "cpu": cpu_name(),
                              "text": "the fp32 model's greedy continuation", "commit": _source_commit()}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
