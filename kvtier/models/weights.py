"""Reading a directory's safetensors weights: one file or index-listed shards, with a progress bar when it
takes long enough to wonder."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvtier.progress import heartbeat

INDEX = "model.safetensors.index.json"
_SHOW_PROGRESS_BYTES = 1 << 30  # below ~1 GB a load takes a second or two: no bar


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory. With an index, only the files it names: some repos
    ship a consolidated copy beside the shards, and loading both would double the memory."""
    index = path / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files)
    show = len(files) > 1 or total > _SHOW_PROGRESS_BYTES
    state: dict[str, torch.Tensor] = {}
    beat = heartbeat(f"loading {total / 1e9:.1f} GB of weights") if show and not sys.stderr.isatty() else nullcontext()
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", file=sys.stderr,
              disable=None if show else True) as bar, beat:  # a bar on a terminal, else a line every few seconds
        for f in files:
            state.update(load_file(str(f)))
            bar.update(f.stat().st_size)
    return state
