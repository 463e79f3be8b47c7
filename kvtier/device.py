"""Which device the engine runs on: `auto`, `cpu`, `cuda` or `cuda:N`, resolved once, up front.

`auto` picks CUDA when this torch build sees a GPU. Asking for CUDA where there is none is a
`DeviceError` (the CLI turns it into a one-line message and exit status 2), never a traceback at
the first kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI parses its options without loading torch
    import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """A device name this machine cannot run on."""


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    import torch

    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: use {DEVICE_CHOICES}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(f"device {name!r}: kvtier runs on {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DeviceError(f"device {name!r}: no CUDA GPU is visible to this torch {torch.__version__} ({build}); "
                          "use --device cpu (or auto)")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """A name that identifies the hardware a measurement was taken on (profiles are keyed by it)."""
    import torch

    if device.type != "cuda":
        return "cpu"
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} sm{p.major}{p.minor} cuda{torch.version.cuda}"


DEVICE_HELP = "where the model, KV pool and restores run: auto (CUDA when available), cpu, cuda, cuda:N"


def add_device_argument(p) -> None:  # an argparse parser or argument group
    p.add_argument("--device", default="auto", metavar="DEVICE", help=f"{DEVICE_HELP} (default: auto)")
