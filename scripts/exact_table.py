"""The bf16 cache-hit table of docs/exactness.md: one chat (a ~1,100-word system document and a short
question, greedy, 12 tokens) served fresh, again from the device prefix cache, and by an engine with
the prefix cache off; in the exact default and with --fast-inexact. Prints a markdown table.

    .venv/bin/python scripts/exact_table.py [--dtype bf16] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    torch.set_num_threads(2)
    m = load_model(args.model, dtype=args.dtype)
    doc = " ".join((ROOT / "docs" / "architecture.md").read_text().split()[:1100])
    messages = [{"role": "system", "content": doc},
                {"role": "user", "content": "Which word comes first in the document above?"}]
    params = SamplingParams(max_tokens=12, temperature=0.0, first_logits=True)
    print("| mode | how the prompt was served | tokens reused | answer |\n|---|---|---|---|")
    for exact in (False, True):
        mode = "exact (default)" if exact else "--fast-inexact"
        rows = []
        e = Engine(m, EngineConfig(kv_cache_bytes=512 << 20, max_model_len=4096, exact=exact))
        try:
            ids = e.encode_chat(messages)
            rows.append(("fresh engine, first request", e.generate([ids], params)[0]))
            rows.append(("the same request again", e.generate([ids], params)[0]))
        finally:
            e.close()
        e = Engine(m, EngineConfig(kv_cache_bytes=512 << 20, max_model_len=4096, exact=exact,
                                   enable_prefix_cache=False))
        try:
            rows.append(("an engine with the prefix cache off", e.generate([ids], params)[0]))
        finally:
            e.close()
        for how, out in rows:
            print(f"| {mode} | {how} | {out.prompt_tokens_reused} of {out.prompt_tokens} | `{out.text!r}` |")
        first = rows[0][1].first_logits
        equal = all(torch.equal(first, out.first_logits) for _, out in rows)
        print(f"| {mode} | first-token logits bit-equal in all three | | {equal} |")


if __name__ == "__main__":
    main()
