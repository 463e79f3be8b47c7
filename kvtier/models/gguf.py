"""A GGUF file converted once into a Hugging Face directory in the compute dtype, cached under the home.

Tensors are dequantized one at a time from the memory-mapped file, in float32 exactly as transformers'
GGUF loader does (gguf's `dequantize`, then transformers' own name map and Q/K un-permutation), and cast
to the target dtype on the way to disk. So the weights are bit for bit transformers' fp32 load cast to
the dtype, while peak memory is one shard plus one tensor, not the whole model in float32 (a 4 GB Q4 7B
file would otherwise take ~28 GB).

Cache layout under `home/models/`, keyed by the file's path, size and mtime:
  <stem>-<tag>-meta/       config.json and tokenizer: read once per file, shared by every dtype
  <stem>-<tag>-tokenizer/  the tokenizer alone, for the presets (which take SmolLM2's): no config parse
  <stem>-<tag>-<dtype>/    a complete HF directory: sharded safetensors + index, config, tokenizer
A directory is written under a temporary name and renamed when complete, so a crash or a concurrent
conversion never leaves a half-written one in place. The older single-file `<stem>-<tag>/` directories
are simply no longer looked at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvtier.dtypes import name_of
from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.weights import INDEX, weight_files
from kvtier.progress import heartbeat

SHARD_BYTES = 2 << 30  # safetensors files of at most ~2 GB: bounded memory while writing, and copyable
DONE = "kvtier.json"  # written last, inside the temporary directory: its presence means complete


@dataclass(frozen=True)
class GgufCache:
    root: Path  # home/models
    key: str  # <stem>-<tag>

    @staticmethod
    def of(path: Path, home: Path) -> GgufCache:
        stat = path.stat()
        tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return GgufCache(home / "models", f"{path.stem}-{tag}")

    @property
    def meta(self) -> Path:
        return self.root / f"{self.key}-meta"

    @property
    def tokenizer(self) -> Path:
        return self.root / f"{self.key}-tokenizer"

    def weights(self, dtype: torch.dtype) -> Path:
        return self.root / f"{self.key}-{name_of(dtype)}"


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[tuple[str, ...], ...]  # tensor names per file, in write order
    total_bytes: int  # in the target dtype

    def file_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], limit: int = SHARD_BYTES) -> ShardPlan:
    """Greedy, in file order: a new shard when the next tensor would take this one past `limit` (a single
    larger tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not shards or (used + nbytes > limit and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return ShardPlan(tuple(tuple(s) for s in shards), sum(n for _, n in sizes))


class TensorSource(Protocol):
    def numels(self) -> list[tuple[str, int]]: ...  # (HF name, element count), in file order

    def tensor(self, name: str) -> torch.Tensor: ...  # full precision (float32)


@dataclass(frozen=True)
class _TopLevel:
    """A model as transformers' GGUF name mapping sees it, without its submodules. The mapping rebuilds
    gguf's name table for every submodule it recurses into (~400 times, seconds, for a 30-layer model);
    the full parameter names at the top level already map every tensor of the decoders kvtier runs (the
    recursion is for Bloom-style checkpoints saved from the bare base model)."""

    model: Any

    @property
    def config(self) -> Any:
        return self.model.config

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def named_children(self) -> list[tuple[str, Any]]:
        return []


@dataclass(frozen=True)
class RawTensor:
    """One tensor of the file as gguf's reader presents it: float32/float16 values, or the raw bytes
    (quantized blocks, bf16) shaped [..., bytes per row]. Memory-mapped: nothing is read until used."""

    name: str  # the GGUF name
    ggml_type: int
    numel: int
    data: Any  # np.ndarray


def read_tensor_table(path: Path) -> tuple[str, list[RawTensor]]:
    """(architecture, tensors) of a GGUF file. gguf's GGUFReader parses every metadata array (the
    tokenizer's ~100k strings: seconds); transformers >= 5.2 has a table reader that skips them, used
    when present, with the same arrays built over the same memory map."""
    import numpy as np

    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import read_field

        reader = GGUFReader(str(path))
        return (read_field(reader, "general.architecture")[0],
                [RawTensor(t.name, int(t.tensor_type), int(t.n_elements), t.data) for t in reader.tensors])
    header = GgufHeader.from_file(str(path))
    blob = np.memmap(path, mode="r")
    tensors = []
    for info in header.tensors:
        start = header.data_start + info.offset
        raw = blob[start:start + info.nbytes]
        numel = int(np.prod(info.shape))
        rows = numel // info.shape[-1]
        data: Any
        if info.ggml_type == 0:  # F32
            data = raw.view(np.float32).reshape(info.shape)
        elif info.ggml_type == 1:  # F16
            data = raw.view(np.float16).reshape(info.shape)
        else:  # blocks (and bf16, which numpy lacks): bytes per row, as GGUFReader shapes them
            data = raw.reshape(*info.shape[:-1], info.nbytes // max(rows, 1))
        tensors.append(RawTensor(info.name, info.ggml_type, numel, data))
    return header.architecture, tensors


class GgufSource:
    """The file's tensors under transformers' names, dequantized on demand."""

    def __init__(self, path: Path, config: Any) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        arch, tensors = read_tensor_table(path)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        # transformers maps GGUF names through a model instance; on the meta device it costs nothing.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        self.names: dict[str, str] = get_gguf_hf_weights_map(_TopLevel(model), self.processor)
        self.tensors = {self.names[t.name]: t for t in tensors if t.name in self.names}
        if getattr(config, "tie_word_embeddings", False):
            self.tensors.pop("lm_head.weight", None)

    def numels(self) -> list[tuple[str, int]]:
        return [(name, t.numel) for name, t in self.tensors.items()]

    def tensor(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize

        t = self.tensors[name]
        weights = dequantize(t.data, GGMLQuantizationType(t.ggml_type))  # float32, as transformers' loader
        result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.names,
                                        parsed_parameters={"tensors": {}})
        if result.name != t.name:  # only MoE processors rename, and kvtier runs none of those
            raise ModelLoadError(f"GGUF tensor {t.name} needs a conversion kvtier does not do")
        return torch.from_numpy(np.copy(result.weights))


class SafetensorsSource:
    """An earlier, wider conversion of the same file: casting it down is the same bits as converting the
    GGUF again (both are the float32 values cast), without parsing and dequantizing the file twice."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.sizes: list[tuple[str, int]] = []
        for f in weight_files(path):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    self.where[k] = f
                    self.sizes.append((k, int(torch.Size(h.get_slice(k).get_shape()).numel())))

    def numels(self) -> list[tuple[str, int]]:
        return self.sizes

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.where[name]), "pt") as h:
            return h.get_tensor(name)


def write_shards(source: TensorSource, dtype: torch.dtype, out: Path, limit: int = SHARD_BYTES) -> ShardPlan:
    """Cast each tensor to `dtype` and write shards of at most `limit` bytes plus the index json."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    width = torch.empty(0, dtype=dtype).element_size()
    plan = plan_shards([(n, k * width) for n, k in source.numels()], limit)
    weight_map: dict[str, str] = {}
    with tqdm(total=sum(len(s) for s in plan.shards), unit="tensor", desc=f"converting to {name_of(dtype)}",
              file=sys.stderr, disable=None) as bar:
        for i, names in enumerate(plan.shards):
            shard = {}
            for n in names:
                shard[n] = source.tensor(n).to(dtype).contiguous()
                bar.update()
            save_file(shard, str(out / plan.file_name(i)), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, plan.file_name(i)))
            del shard  # before the next shard is built: at most one in memory
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return plan


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _temporary(out: Path) -> Path:
    # Per process, so two converting at once do not collide; those left by a killed conversion (GBs,
    # possibly) go now.
    for old in out.parent.glob(f"{out.name}.tmp-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    if out.exists() and not (out / DONE).exists():  # not ours and not complete: cannot be trusted
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process completed the same conversion first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def metadata_dir(path: Path, home: Path) -> Path:
    """config.json and the tokenizer of a GGUF file, read once."""
    out = GgufCache.of(path, home).meta
    if (out / DONE).exists():
        return out
    from transformers import AutoConfig

    try:
        # transformers parses every metadata field in Python (the vocabulary's among them): seconds
        # for a small model's file, so once per file.
        with heartbeat(f"reading the config and tokenizer of {path.name} (once)"):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            tok = _tokenizer(path, config.model_type)
    except Exception as e:
        raise ModelLoadError(
            f"cannot read GGUF {path}: {e}. The file may be corrupt or of an unsupported architecture "
            "(kvtier runs llama, mistral and qwen2 GGUF files)"
        ) from e
    ModelConfig.from_hf(config)  # rejects unsupported architectures with a clear message, before any work
    tmp = _temporary(out)
    hf_cfg = config.to_dict()
    hf_cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, default=str))
    tok.save_pretrained(str(tmp))
    (tmp / DONE).write_text(json.dumps({"source": str(path)}))
    _publish(tmp, out)
    return out


def tokenizer_dir(path: Path, home: Path, model_type: str) -> Path:
    """The tokenizer of a GGUF file whose architecture the caller knows, read once: all a preset needs.
    Parsing the config besides (transformers reads every metadata field, 49K tokens among them, in
    Python) took most of a preset's first start; the tokenizer alone takes a fraction of it."""
    cache = GgufCache.of(path, home)
    for out in (cache.meta, cache.tokenizer):  # a full conversion's directory holds the same tokenizer
        if (out / DONE).exists():
            return out
    out = cache.tokenizer
    try:
        tok = _tokenizer(path, model_type)
    except Exception as e:
        raise ModelLoadError(f"cannot read the tokenizer of GGUF {path}: {e}") from e
    tmp = _temporary(out)
    tok.save_pretrained(str(tmp))
    (tmp / DONE).write_text(json.dumps({"source": str(path)}))
    _publish(tmp, out)
    return out


def _tokenizer(path: Path, model_type: str) -> Any:
    """The tokenizer AutoTokenizer reads from the file, parsing it once.

    AutoTokenizer parses a GGUF's whole metadata again for the config, which is only needed to pick
    the tokenizer class (about half of a preset's first start). A model type
    with no class of its own (llama) gets the generic fast tokenizer there: built directly, the same
    files. Other types name their class, which skips that parse too."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if TOKENIZER_MAPPING_NAMES.get(model_type) is None:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_type=model_type)


def convert(path: Path, home: Path, dtype: torch.dtype) -> Path:
    """The HF directory of `path` in `dtype`, converting it the first time."""
    cache = GgufCache.of(path, home)
    out = cache.weights(dtype)
    if (out / DONE).exists():
        return out
    meta = metadata_dir(path, home)
    wider = cache.weights(torch.float32)
    from_wider = dtype != torch.float32 and (wider / DONE).exists()
    if from_wider:
        source: TensorSource = SafetensorsSource(wider)
    else:
        from transformers import AutoConfig

        try:
            source = GgufSource(path, AutoConfig.from_pretrained(str(meta)))
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read the tensors of GGUF {path}: {e}") from e
    width = torch.empty(0, dtype=dtype).element_size()
    gb = sum(n for _, n in source.numels()) * width / 1e9
    # Printed, not logged: the CLI shows warnings only, and a multi-GB write should never be a surprise.
    tmp = _temporary(out)
    try:
        with heartbeat(f"converting {path.name} to {name_of(dtype)} safetensors: {gb:.2f} GB in {out} (once"
                       + (", cast from the float32 conversion)" if from_wider else ")")):
            write_shards(source, dtype, tmp)
        for f in meta.iterdir():
            if f.name not in (DONE, "config.json"):
                shutil.copy2(f, tmp / f.name)
        hf_cfg = json.loads((meta / "config.json").read_text())
        hf_cfg["dtype"] = name_of(dtype)  # what transformers loads it in when not told otherwise
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        (tmp / DONE).write_text(json.dumps({"source": str(path), "dtype": name_of(dtype)}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out)
    return out
