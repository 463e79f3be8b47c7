"""Time to first token and time between tokens through `kvtier serve`: a server started as users
start it, greedy streamed completions one at a time.

    python scripts/serve_tbt.py [--model smollm2-135m] [--dtype bf16] [--requests 4] [--tokens 48]

Reports each request's TTFT and median time between streamed tokens, and the machine.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from kvtier.bench.common import machine_info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stream(url: str, model: str, prompt: str, tokens: int) -> tuple[float, float]:
    """-> (seconds to the first token, median seconds between tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = []
    t0 = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                stamps.append(time.perf_counter())
    return stamps[0] - t0, statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--requests", type=int, default=4, help="timed requests, after one untimed (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request (default: %(default)s)")
    args = ap.parse_args()
    m = machine_info()
    print(f"{m['cpu_model']} ({m['cpu_id']}), {m['cpu_count']} CPUs, torch {m.get('torch')}; {args.model} {args.dtype}")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--model", args.model, "--dtype", args.dtype,
                               "--port", str(port), "--no-store"], stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        for line in server.stderr:  # the banner says it listens
            if "kvtier serving" in line:
                break
        else:
            raise SystemExit(f"the server exited ({server.wait()}) before it listened")
        threading.Thread(target=server.stderr.read, daemon=True).start()  # its log, drained: a full pipe would stall it
        url = f"http://127.0.0.1:{port}/v1/completions"
        _stream(url, args.model, "A warm-up.", 4)
        for i in range(args.requests):
            ttft, tbt = _stream(url, args.model, f"Request {i}: the story of the number {i}, told at length.",
                                args.tokens)
            print(f"request {i}: TTFT {ttft * 1000:.0f} ms, time between tokens {tbt * 1000:.1f} ms (median)")
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
