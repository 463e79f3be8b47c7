"""How long the event loop stalls while a large request body is decoded and validated.

Two apps serve the server's own request models: one with FastAPI's route (the body decoded and
validated on the loop), one with kvtier's (`serve/bodies.py`: on a worker thread). A task ticks
every millisecond on the loop; its longest gap during a request is the stall every other request
and stream would see. Bodies at the server's default size limit, made of many small objects, the
worst case for validation, and of many empty arrays, the worst case for decoding (a full garbage
collection scans the process's heap each time the body's containers trigger one: the process
keeps --heap small objects alive, as many as a server of SmolLM2 holds). Rounds alternate the two
routes.

    python scripts/body_parse_stall.py --rounds 7 --json FILE
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from kvtier.bench.common import machine_info
from kvtier.bench.loop_stall import loop_stall
from kvtier.serve.bodies import OffLoopBodyRoute
from kvtier.serve.config import DEFAULT_MAX_BODY_BYTES
from kvtier.serve.errors import install_error_handlers
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest

# len(gc.get_objects()) in a process serving SmolLM2-135M (create_app over an Engine, after gc.collect()).
SERVED_HEAP = 344_000


def _app(route_class: type[APIRoute]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=route_class)

    @router.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"messages": len(body.messages)}

    @router.post("/completion")
    async def completion(body: CompletionRequest) -> dict:
        return {"ok": True}

    app.include_router(router)
    return app


def _bodies(limit: int) -> dict[str, tuple[str, bytes]]:
    msg = {"role": "user", "content": "a"}
    n = (limit - 100) // (len(json.dumps(msg)) + 2)
    chat = {"model": "m", "messages": [msg] * n}
    bad = {"model": "m", "messages": [msg] * (n - 1) + [{"role": "wizard", "content": "a"}]}
    ids = {"model": "m", "prompt": [1] * ((limit - 100) // 3)}
    empty = {"model": "m", "messages": [{}] * ((limit - 100) // 3)}
    arrays = {"model": "m", "messages": [msg], "x": [[]] * ((limit - 100) // 3)}
    return {f"chat, {n:,} messages": ("/chat", json.dumps(chat).encode()),
            f"chat, {n:,} messages, the last invalid": ("/chat", json.dumps(bad).encode()),
            f"completion, {len(ids['prompt']):,} token ids": ("/completion", json.dumps(ids).encode()),
            f"chat, {len(empty['messages']):,} empty (invalid) messages": ("/chat", json.dumps(empty).encode()),
            f"chat, an unknown field of {len(arrays['x']):,} empty arrays": ("/chat", json.dumps(arrays).encode())}


async def _one(client: httpx.AsyncClient, path: str, raw: bytes) -> tuple[float, float, int]:
    r, took, gap = await loop_stall(lambda: client.post(path, content=raw, headers={"content-type": "application/json"}))
    return gap * 1e3, took * 1e3, r.status_code


async def _run(rounds: int, limit: int) -> dict[str, Any]:
    apps = {"FastAPI's route (on the loop)": _app(APIRoute), "kvtier's route (off the loop)": _app(OffLoopBodyRoute)}
    clients = {name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=60)
               for name, app in apps.items()}
    rows: dict[str, dict[str, list]] = {}
    try:
        for body, (path, raw) in _bodies(limit).items():
            for i in range(rounds):
                for name in (list(clients) if i % 2 == 0 else list(reversed(clients))):
                    gap, took, status = await _one(clients[name], path, raw)
                    row = rows.setdefault(f"{body} | {name}", {"gap_ms": [], "request_ms": [], "status": []})
                    row["gap_ms"].append(gap)
                    row["request_ms"].append(took)
                    row["status"].append(status)
    finally:
        for c in clients.values():
            await c.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="body size (default: the server's limit)")
    ap.add_argument("--heap", type=int, default=SERVED_HEAP,
                    help="small objects kept alive (default: %(default)s, the gc-tracked objects of a served SmolLM2)")
    ap.add_argument("--json", help="write the raw timings here")
    args = ap.parse_args()
    heap = [[i] for i in range(args.heap)]  # noqa: F841 (alive while the rounds run)
    gc.collect()
    rows = asyncio.run(_run(args.rounds, args.bytes))
    print(f"{'body | route':78} {'loop stall ms, median (range)':>30} {'request ms':>11} status")
    for key, row in rows.items():
        g = row["gap_ms"]
        print(f"{key:78} {statistics.median(g):9.1f} ({min(g):.1f}-{max(g):.1f}){'':>8}"
              f" {statistics.median(row['request_ms']):9.0f}   {sorted(set(row['status']))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "bytes": args.bytes, "heap": args.heap,
                       "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
