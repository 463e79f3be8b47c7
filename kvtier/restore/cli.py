"""`kvtier profile`: measure this machine's compute and tier read rates for a model."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.models.loading import DEFAULT_MODEL, load_model
from kvtier.restore.profile import measure, profile_path


def cmd_profile(args: argparse.Namespace) -> int:
    from kvtier.store.cli import kvtier_home

    model = load_model(args.model, dtype=args.dtype, tokenizer=False)
    prof = measure(model, args.store)
    out = Path(args.json) if args.json else profile_path(Path(kvtier_home()), model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.to_json())
    print(f"prefill: {prof.prefill_a * 1e3:.3f} ms/token + {prof.prefill_b * 1e6:.4f} us/token^2 "
          f"({', '.join(f'{n} tok {t:.3f}s' for n, t in prof.points)})")
    print(f"hidden->KV projection: {prof.project_s * 1e6:.2f} us/token/layer; RoPE+place: {prof.place_s * 1e6:.2f} us/token/layer")
    for name, r in prof.tiers.items():
        print(f"tier {name}: whole-chunk {r.chunk_bps / 1e9:.2f} GB/s, per-layer {r.layer_bps / 1e9:.2f} GB/s, "
              f"{r.read_latency_s * 1e6:.0f} us/read")
    print(f"wrote {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from kvtier.store.cli import add_store_argument

    p = sub.add_parser("profile", help="measure compute and tier read rates; the planner loads the JSON")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--json", default=None, help="output path (default: KVTIER_HOME/profiles/<model>-<dtype>.json)")
    add_store_argument(p)
    p.set_defaults(func=cmd_profile)
