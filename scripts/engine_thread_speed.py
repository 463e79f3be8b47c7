"""The same requests stepped on the main thread, on another thread while the main thread holds
an OpenMP team (as the server's engine loop ran when the main thread loaded the model), and on
the main thread while an idle thread holds an OpenMP team of its own (as a thread pool's restore
worker would between restores): time to the first token and time between tokens of each.

    python scripts/engine_thread_speed.py [--model smollm2-135m] [--dtype bf16] [--prompt 150] [--rounds 1]

torch's CPU ops run on an OpenMP team per calling thread (libgomp in torch's wheels). Once a
second thread has run a parallel op, the process holds more OpenMP threads than CPUs, and libgomp
then lets every team's workers sleep between ops instead of spinning (on the main thread too), so
each small op (a decode step's, a short prefill's) pays a wake-up. OMP_WAIT_POLICY=PASSIVE makes a
lone main thread as slow, which is how the cause shows itself.
"""

from __future__ import annotations

import argparse
import statistics
import threading

import torch

from kvtier.bench.common import machine_info
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model


def _run(engine: Engine, prompt: list[int], tokens: int) -> RequestOutput:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompt, params, cache_prompt=False)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", type=int, default=150, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens generated per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="the three cases, this many times (default: %(default)s)")
    args = ap.parse_args()
    m = machine_info()
    print(f"{m['cpu_model']} ({m['cpu_id']}), {m['cpu_count']} CPUs, torch {m.get('torch')}, "
          f"{m.get('torch_threads')} threads; {args.model} {args.dtype}")
    loaded = load_model(args.model, dtype=args.dtype, tokenizer=False)
    ids = torch.randint(3, loaded.config.vocab_size, (args.prompt + 30,), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(loaded) as engine:
        _run(engine, ids[:64], 4)  # warm-up
        for _ in range(args.rounds):
            for where in ("main thread", "another thread", "main, a team held"):
                outs: list[RequestOutput] = []

                def go(outs: list[RequestOutput] = outs) -> None:
                    outs.extend(_run(engine, ids[i * 10 : i * 10 + args.prompt], args.tokens) for i in range(3))

                if where == "another thread":
                    t = threading.Thread(target=go)
                    t.start()
                    t.join()
                elif where == "main thread":
                    go()
                else:  # an idle thread that ran one op (a restore worker between restores) holds its team
                    done = threading.Event()

                    def hold(done: threading.Event = done) -> None:
                        torch.ones(1 << 16).mul_(2)  # large enough to run on a team
                        done.wait()

                    t = threading.Thread(target=hold)
                    t.start()
                    try:
                        go()
                    finally:
                        done.set()
                        t.join()
                ttft = statistics.median(o.ttft or 0 for o in outs) * 1e3
                tbt = statistics.median(o.mean_tbt or 0 for o in outs) * 1e3
                print(f"{where:17s} TTFT {ttft:6.1f} ms, between tokens {tbt:5.1f} ms (medians of 3 requests)",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
