"""Command-line options for partial token-wise caching (eLLM), shared by the CLI and the server."""

from __future__ import annotations

import argparse

from kvtier.engine.config import PartialConfig


def add_partial_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("partial token-wise caching (eLLM): more sequences in the same KV memory")
    g.add_argument("--partial-caching", choices=["off", "optimizer", "fixed"], default=None,
                   help="let decoding requests keep KV for their newest tokens only and get the oldest back every "
                        "step (recomputed, or from --front-swap-gb): optimizer chooses the batch size and each "
                        "request's uncached front under --tpot-slo-ms; fixed uses --uncached-ratio "
                        "(default: optimizer when --tpot-slo-ms is given, else off)")
    g.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="time-per-output-token SLO in ms: the optimizer admits requests and sizes fronts so that "
                        "decode steps, as the engine observes them, stay within 90%% of it")
    g.add_argument("--uncached-ratio", type=float, default=0.25,
                   help="share of each decoding request's tokens left uncached with --partial-caching fixed")
    g.add_argument("--front-swap-gb", type=float, default=0.0,
                   help="host memory for uncached fronts, read back instead of recomputed where faster (GiB; 0: off)")


def partial_from_args(args: argparse.Namespace) -> PartialConfig | None:
    policy = args.partial_caching or ("optimizer" if args.tpot_slo_ms is not None else "off")
    if policy == "off":
        if args.tpot_slo_ms is not None:
            raise ValueError("--tpot-slo-ms sets the partial-caching optimizer's SLO: drop --partial-caching off")
        return None
    return PartialConfig(policy=policy, ratio=args.uncached_ratio if policy == "fixed" else 0.0,
                         tpot_slo_s=args.tpot_slo_ms / 1e3 if args.tpot_slo_ms is not None else None,
                         swap_bytes=int(args.front_swap_gb * (1 << 30)))
