"""How long a request waits on a dead Redis tier: chat latency through a live server (tiny-gqa, a
redis-only store, no device prefix cache) with Redis up, right after a SIGKILL, during the outage,
and after a restart on the same port. Prints a table (medians of --repeats requests).

    python scripts/redis_outage_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.models.loading import load_model
from kvtier.serve import create_app
from kvtier.serve.server import ServerThread
from kvtier.testing.services import RedisServer

SYSTEM = "You are a careful assistant. " * 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = load_model("tiny-gqa", dtype="fp32")
    with RedisServer() as srv:
        engine = Engine(model, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=256, enable_prefix_cache=False),
                        store=srv.url, reuse=ReuseConfig(method="kv", chunk_tokens=16))
        background = BackgroundEngine(engine)
        with ServerThread(create_app(background, default_max_tokens=4)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            n = 0

            def ask() -> float:
                nonlocal n
                n += 1
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {n}?"}]
                t = time.perf_counter()
                client.chat.completions.create(model="tiny-gqa", messages=msgs, max_tokens=4, temperature=0)
                return time.perf_counter() - t

            rows = [("redis up", statistics.median(ask() for _ in range(args.repeats)))]
            srv.kill()
            rows.append(("first request after SIGKILL", ask()))
            rows.append(("during the outage", statistics.median(ask() for _ in range(args.repeats))))
            srv.start()
            time.sleep(5.5)  # past the longest backoff: the next call probes and finds it
            rows.append(("after restart", statistics.median(ask() for _ in range(args.repeats))))
        background.close()
        engine.close()
    print("| phase | request latency |\n|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
