"""How far bf16 answers lie from fp32 with each exact bf16 attention kernel, beside HF transformers
in bf16 on the same weights: SmolLM2-135M, random contexts of H tokens, the last token's logits
against kvtier's fp32 logits (the reference). kvtier-gemm rounds the attention scores to bf16
before the softmax (as HF's eager attention does); kvtier-flash and HF's SDPA keep them in fp32.

Per H: the median over contexts of the largest logit error, of KL(fp32 || bf16) in nats, and
how many contexts keep fp32's top token. Prints a table and writes JSON.

    cd scripts && python bf16_attention_accuracy.py [--history 1024,4096,8128] [--contexts 4] [--json F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvtier.bench.common import machine_info
from kvtier.bench.hf import build_hf
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, first_logits=True)


def kvtier_logits(loaded, ids: list[int], kernel: str) -> torch.Tensor:
    cfg = EngineConfig(max_model_len=len(ids), enable_prefix_cache=False, bf16_attention=kernel)
    engine = Engine(loaded, cfg)
    try:
        out = engine.generate([ids], FIRST)[0]
    finally:
        engine.close()
    assert out.first_logits is not None
    return out.first_logits.float()


def errors(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return dict(max_abs=(got - ref).abs().max().item(), kl=(logp.exp() * (logp - logq)).sum().item(),
                top1=float(got.argmax() == ref.argmax()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", default="1024,4096,8128", help="context lengths (default: %(default)s)")
    ap.add_argument("--contexts", type=int, default=4, help="random contexts per length (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    fp32 = load_model("smollm2-135m", dtype="fp32", tokenizer=False)
    bf16 = load_model("smollm2-135m", dtype="bf16", tokenizer=False)
    hf = build_hf(bf16)
    rows = []
    print(f"{'H':>5} {'peer':14} {'max |logit err|':>16} {'KL (nats)':>11} {'top-1 kept':>11}")
    for h in (int(x) for x in args.history.split(",")):
        found: dict[str, list[dict[str, float]]] = {"kvtier-gemm": [], "kvtier-flash": [], "hf-sdpa": []}
        for c in range(args.contexts):
            g = torch.Generator().manual_seed(1000 * h + c)
            ids = torch.randint(100, bf16.config.vocab_size, (h + 1,), generator=g).tolist()
            ref = kvtier_logits(fp32, ids, "auto")
            found["kvtier-gemm"].append(errors(ref, kvtier_logits(bf16, ids, "gemm")))
            found["kvtier-flash"].append(errors(ref, kvtier_logits(bf16, ids, "flash")))
            with torch.inference_mode():
                found["hf-sdpa"].append(errors(ref, hf(torch.tensor([ids])).logits[0, -1].float()))
        for peer, errs in found.items():
            row = dict(history=h, peer=peer, contexts=args.contexts,
                       max_abs=statistics.median(e["max_abs"] for e in errs), kl=statistics.median(e["kl"] for e in errs),
                       top1=sum(e["top1"] for e in errs), raw=errs)
            rows.append(row)
            print(f"{h:5d} {peer:14} {row['max_abs']:16.4f} {row['kl']:11.2e} {int(row['top1']):>7d}/{args.contexts}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, meta=dict(machine_info(), model="smollm2-135m")), f, indent=1)


if __name__ == "__main__":
    main()
