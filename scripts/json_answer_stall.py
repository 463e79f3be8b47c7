"""How long writing a large whole answer as JSON on a worker thread stalls the event loop: one
pydantic dump (which holds the GIL throughout) against `responses.json_pieces` (the server's way).

    python scripts/json_answer_stall.py [--samples 16] [--tokens 3100] [--top 20]

Builds a chat answer of `--samples` choices of `--tokens` tokens with `--top` top logprobs each,
writes it on a worker thread while a task on the loop wakes every 5 ms, and prints the answer's
size, the time the write took and the longest the loop went without waking (two runs each).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from fastapi.concurrency import run_in_threadpool

from kvtier.bench.common import machine_info
from kvtier.bench.loop_stall import loop_stall
from kvtier.serve import responses as r


def answer(samples: int, tokens: int, top: int) -> r.ChatCompletion:
    alts = [r.TopLogprob(token=f" tok{i}", logprob=-0.37 * (i + 1), bytes=[32, 116, 111, 107]) for i in range(top)]
    entry = r.ChatTokenLogprob(token=" tok", logprob=-0.25, bytes=[32, 116, 111, 107], top_logprobs=alts)
    choice = r.ChatChoice(index=0, message=r.AssistantMessage(content=" tok" * tokens), finish_reason="length",
                          logprobs=r.ChatLogprobs(content=[entry] * tokens))
    return r.ChatCompletion(id="chatcmpl-x", created=0, model="m", system_fingerprint="fp_x",
                            choices=[choice.model_copy(update={"index": i}) for i in range(samples)],
                            usage=r.Usage(prompt_tokens=1, completion_tokens=samples * tokens,
                                          total_tokens=1 + samples * tokens,
                                          prompt_tokens_details=r.PromptTokensDetails(cached_tokens=0)))


async def stall(write: Callable[[], bytes]) -> tuple[int, float, float]:
    out, took, gap = await loop_stall(lambda: run_in_threadpool(write), tick_s=0.005, settle_s=0.05)
    return len(out), took, gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=3100)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    big = answer(args.samples, args.tokens, args.top)
    print(machine_info())
    for name, write in (("one dump", lambda: big.model_dump_json().encode()),
                        ("in pieces", lambda: b"".join(r.json_pieces(big)))):
        for _ in range(2):
            size, took, gap = asyncio.run(stall(write))
            print(f"{name}: {size / 1e6:.1f} MB in {took:.2f} s, the loop's longest gap {gap * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
