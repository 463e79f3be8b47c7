"""Exact CPU attention split by a query's position (the whole 512-key blocks before its own, then
its 64-key piece, merged: `kvtier/models/exact_attention.py`) against whole 512-key blocks alone
(the attention module of `--before`, read from git), paired per context in one process beside HF's
floor on the same weights (the harness: scripts/paired_ab.py). Each way saves and restores with
its own attention: their stored states differ in bits.

    cd scripts && python key_split_ab.py [--history 1024] [--dtype fp32] [--contexts 12] [--before f741134] [--json F.json]
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import tempfile
from unittest import mock

import paired_ab  # scripts/ is on the path of a script run from it

from kvtier.engine.runner import model_runner, static_decode
from kvtier.models import llama

BEFORE = "f741134"  # the last commit with whole key blocks


def module_at(commit: str):
    """kvtier/models/attention.py as it was at `commit`, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{commit}:kvtier/models/attention.py"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py") as path:
        path.write(text)
        path.flush()
        spec = importlib.util.spec_from_file_location("attention_before", path.name)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def main() -> None:
    args = paired_ab.arguments(__doc__.split("\n\n")[0], lambda ap: ap.add_argument(
        "--before", default=BEFORE, help="the commit whose attention is the other way (default: %(default)s)"))
    old = module_at(args.before)

    @contextlib.contextmanager
    def whole_blocks():
        with contextlib.ExitStack() as stack:
            for mod, names in ((model_runner, ("causal_attention", "decode_attention", "key_rows")),
                               (static_decode, ("decode_attention", "key_rows")), (llama, ("causal_attention",))):
                for name in names:
                    stack.enter_context(mock.patch.object(mod, name, getattr(old, name)))
            yield

    paired_ab.run({"split": contextlib.nullcontext, "whole blocks": whole_blocks}, args)


if __name__ == "__main__":
    main()
