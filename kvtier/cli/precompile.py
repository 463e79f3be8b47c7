"""`kvtier precompile FILE...`: store documents' state computed alone, so blended requests (a
server's --blend) load it at any position from the first time they meet them.

Each text file is one document (its final line break not part of it); a `.jsonl` file holds one
per line (a JSON string, or an object with a "text" field). Give the engine options the server
runs with (model, dtype, store, restore method): the state is stored under that model's and
layout's namespace.
"""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.document_files import read_documents
from kvtier.cli.engine_args import EngineOptions, add_engine_arguments


def cmd_precompile(args: argparse.Namespace) -> int:
    try:
        docs = read_documents(args.files)
    except (OSError, ValueError) as e:
        print(f"kvtier precompile: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    stored = computed = refused = 0
    # Planned on the saved profile or an estimate, as `kvtier serve` starts: the store's layout
    # (and with it the namespace the documents are stored under) is chosen the same way.
    with EngineOptions.from_args(args).build(measure_profile=False) as engine:  # saves drained, threads stopped
        for i, doc in enumerate(tqdm(docs, desc="documents", unit="doc", disable=None)):
            try:
                found, made = engine.precompile([doc], args.cache_salt)
            except ValueError as e:  # PromptError too: a document too long is named, the rest go on
                print(f"kvtier precompile: document {i}: {e}", file=sys.stderr)
                refused += 1
                continue
            stored, computed = stored + found, computed + made
        engine.flush()
    print(f"{len(docs)} documents: {computed} computed and stored, {stored} stored already"
          + (f", {refused} refused" if refused else ""))
    return 1 if refused else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("precompile", help="store documents' state computed alone, for blended requests (--blend)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE", help="a text file (one document) or a .jsonl file (one per line)")
    p.add_argument("--cache-salt", default=None, help="the cache partition the documents are for (a tenant's salt)")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_precompile)
