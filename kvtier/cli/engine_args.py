"""Every option of a command that runs an engine, declared once, as the fields of `EngineOptions`:
generate, chat, demo and serve take them all, the benchmarks and `kvtier profile` the model ones,
and the Python API (`kvtier.LLM`) takes them as keywords.

Each option maps to one field of EngineConfig, ReuseConfig, ImpressConfig or PartialConfig; the
configs validate values, the options only parse them (kvtier/cli/options.py makes the flags).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvtier import paths
from kvtier.cli.options import add_options, from_args, option
from kvtier.device import DEVICE_HELP
from kvtier.dtypes import canonical
from kvtier.engine.config import DEFAULT_CHUNK_TOKENS
from kvtier.models import DEFAULT_MODEL
from kvtier.planning.plan import METHOD_CHOICES
from kvtier.store.spec import SPEC_HELP, SpecError, parse_spec

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvtier.engine.config import ImpressConfig, PartialConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.planning.blend import BlendOptions

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
# vLLM's --dtype names for the same dtypes (its choices: auto, half, float16, bfloat16, float, float32).
_DTYPE_SYNONYMS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


# ----- value types (argparse turns their errors into a usage line and exit 2) -----------------------
def _number(text: str, kind: type, ok: Any, what: str) -> Any:
    try:
        x = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return x


def positive_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda x: x > 0, "a positive number")


def non_negative(text: str) -> float:
    return _number(text, float, lambda x: x >= 0, "a number >= 0")


def ratio(text: str) -> float:
    return _number(text, float, lambda x: 0.0 < x <= 1.0, "a number in (0, 1]")


def odd_window(text: str) -> int:
    return _number(text, int, lambda x: x >= 1 and x % 2 == 1, "an odd number of tokens >= 1")


def dtype_name(text: str) -> str:
    """A --dtype value in kvtier's names (bfloat16 -> bf16, half -> fp16, float -> fp32); a name
    that is neither kvtier's nor vLLM's is left for the choices check to refuse."""
    name = text.strip().lower()
    return _DTYPE_SYNONYMS.get(name, name)


def default_store_spec(home: str | None = None) -> str:
    """--store's default: 2GB of memory over a 20GB disk tier under the kvtier home."""
    return f"memory:2GB,disk:{home or paths.home()}/store:20GB"


def spec_type(text: str) -> str:
    try:
        parse_spec(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def max_threads() -> int:
    """The most --threads allowed: four per CPU (more only adds switching between them)."""
    return (os.cpu_count() or 1) * 4


def check_threads(n: int) -> int:
    if not 1 <= n <= max_threads():
        raise ValueError(f"--threads must be from 1 to {max_threads()} (4 per CPU of this machine's "
                         f"{os.cpu_count() or 1}), got {n}")
    return n


def thread_count(text: str) -> int:
    n = _number(text, int, lambda x: True, "a number of threads")
    try:
        return check_threads(n)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--threads ")) from None


# ----- the options ---------------------------------------------------------------------------------
MODEL, ENGINE, STORE, PARTIAL = "model", "engine", "store", "partial"
TITLES = {MODEL: "model and engine", ENGINE: "model and engine", STORE: "state store (reuse across requests)",
          PARTIAL: "partial token-wise caching (eLLM): more sequences in the same KV memory"}


def _storage_dtype(text: str) -> str:
    if text in ("", "auto"):
        return "auto"
    canonical(text)  # raises naming the choices
    return text


@dataclass(frozen=True)
class EngineOptions:
    """Every option of a command that runs an engine, declared once: each field is a flag of
    generate, chat, demo and serve (and of the Python API's `LLM(...)`), a `--config` file key and a
    `KVTIER_<NAME>` environment variable. `build()` turns them into the engine's validated configs."""

    model: str = option(DEFAULT_MODEL, MODEL, f"preset (tiny-mha, tiny-gqa, mha-1b, ...), {DEFAULT_MODEL}, a Hugging "
                        "Face model directory or Hub id (org/name), or a .gguf file", aliases=("-m",))
    dtype: str = option("auto", MODEL, "compute dtype; auto = bf16 on a GPU or a CPU with native bf16, else fp32 "
                        "(vLLM's bfloat16, float16, half, float32 and float are accepted too)", type=dtype_name,
                        choices=DTYPE_CHOICES)
    device: str = option("auto", MODEL, DEVICE_HELP, metavar="DEVICE")
    max_model_len: int | None = option(None, ENGINE, "context window in tokens; more than the model's "
                                       "(max_position_embeddings) is refused", type=positive_int,
                                       default_text="the model's", aliases=("-c", "--ctx-size"))
    kv_cache_gb: float | None = option(None, ENGINE, "KV pool budget on the device in GiB; on a CPU, pages are used "
                                       "only as blocks fill", type=positive_float,
                                       default_text="4 on a CPU; on a GPU, --gpu-memory-utilization of its memory "
                                       "less the weights and a step's activations")
    max_batched_tokens: int | None = option(None, ENGINE, "per-step token budget shared by decodes and prefill chunks",
                                            type=positive_int, default_text="2048 on a CPU, 16384 on a GPU",
                                            aliases=("--max-num-batched-tokens",))
    gpu_memory_utilization: float = option(0.9, ENGINE, "share of a GPU's memory the engine may use (weights, "
                                           "activations and the KV pool) when --kv-cache-gb is not set",
                                           type=positive_float)
    enforce_eager: bool = option(False, ENGINE, "decode without CUDA graphs (default: plain decode steps on a GPU "
                                 "replay one captured graph per batch-size bucket)")
    max_num_seqs: int = option(64, ENGINE, "most requests in the running batch; the rest queue", type=positive_int)
    no_prefix_cache: bool = option(False, ENGINE, "disable the device prefix cache (reuse then comes only from the "
                                   "store)", aliases=("--no-enable-prefix-caching",),
                                   off=("--enable-prefix-caching",))
    fast_inexact: bool = option(False, ENGINE, "plain kernels instead of the row-invariant ones: a little faster in "
                                "places, but a cache hit, a restore, another prefill chunking or batch may then change "
                                "a token's logits (bf16, fp16; its state is stored apart from exact state) "
                                "(default: exact)")
    bf16_attention: str = option("auto", ENGINE, "exact bf16 attention's CPU kernel: gemm (oneDNN's GEMMs, where a "
                                 "check at first use finds every call shape it makes row-invariant on this CPU), "
                                 "flash (the fused flash kernel) or auto (gemm on CPUs with avx512_bf16 and no AMX, "
                                 "flash elsewhere); the start logs which runs and why",
                                 choices=("auto", "gemm", "flash"))
    no_idle_measuring: bool = option(False, ENGINE, "serve on the estimate and the quick kernel checks a first start "
                                     "makes, without measuring this machine while no request is in flight "
                                     "(`kvtier profile` measures it; default: measured while idle, then adopted)")
    threads: int | None = option(None, ENGINE, "torch's CPU compute threads, set before the model loads. On an idle "
                                 "machine more are faster; lower it where other work keeps the cores busy (on a busy "
                                 "2-core machine one thread decoded 10x faster than two). The machine profile is "
                                 "measured per thread count", type=thread_count, metavar="N", aliases=("-t",),
                                 default_text="torch's: $OMP_NUM_THREADS, else one per physical core")

    store: str = option(default_store_spec, STORE, f"tiered state store: {SPEC_HELP}", type=spec_type,
                        metavar="SPEC")
    no_store: bool = option(False, STORE, "run without the state store (no saving, no restore)")
    chunk_tokens: int = option(DEFAULT_CHUNK_TOKENS, STORE, "tokens per stored chunk (larger: fewer, larger reads; a "
                               "chunk is reused in part, in steps of 16 tokens, where a prompt stops or parts inside it)",
                               type=positive_int)
    storage_dtype: str = option("auto", STORE, "dtype chunks are stored in: auto = the compute dtype (lossless); "
                                "fp16, bf16 or int8 store less and are lossy (their state is stored apart from exact "
                                "state, under keys a lossless restore never reads)", type=_storage_dtype)
    min_restore_tokens: int = option(32, STORE, "restore from the store only when it adds at least this many tokens "
                                     "over the device prefix cache (fewer are recomputed)", type=non_negative_int)
    store_secret_file: str | None = option(None, STORE, "a secret shared by every server of this store (at least 16 "
                                           "bytes, first line of the file): chunks are sealed with an HMAC and only "
                                           "sealed ones are used, so whoever can write to the store's Redis or "
                                           "directories cannot plant state (see docs/serve.md, Security)",
                                           metavar="PATH", default_text="none")
    store_secret: str | None = option(None, STORE, "the store secret as a value (visible to other users in `ps`: "
                                      "prefer the file or $KVTIER_STORE_SECRET)", metavar="SECRET", secret=True,
                                      env=False)  # load_secret reads $KVTIER_STORE_SECRET, after a file
    restore_method: str = option("auto", STORE, "how stored state comes back: auto (the planner decides per request), "
                                 "kv, hidden, bubblefree, cake, recompute, or impress (lossy, opt-in: only the stored "
                                 "prefix tokens the new tokens attend to; its state is never saved)",
                                 choices=tuple(METHOD_CHOICES))
    allow_lossy: bool = option(False, STORE, "with --restore-method auto: the planner may also choose impress where it "
                               "predicts it at least 15% faster than every exact method (stores the importance layout; "
                               "lossy, so off by default)")
    importance_ratio: float = option(0.25, STORE, "impress: share of a stored prefix each layer keeps", type=ratio,
                                     metavar="R")
    importance_unit: str = option("granule", STORE, "impress: keep whole stored granules of 16 tokens chosen by their "
                                  "summed importance (reads follow the ratio), or single tokens (the paper)",
                                  choices=("granule", "token"))
    importance_window: int = option(17, STORE, "impress: each token's importance is the highest within W tokens "
                                    "centred on it before choosing (odd; 1: none), so what follows and surrounds an "
                                    "important token is kept with it", type=odd_window, metavar="W")
    importance_vote: str = option("sum", STORE, "impress: the probe heads' choice is by their summed importance (sum), "
                                  "or tokens in at least two probes' top-k first (majority)", choices=("sum", "majority"))
    importance_selection: str = option("probes", STORE, "impress: how tokens are chosen: the probe heads in every "
                                       "layer (probes), probe heads first and every key only where they disagree "
                                       "(impress, the paper: more bytes), or every key and every head (h2o: more bytes, closer to "
                                       "full accuracy on models with few KV heads)", choices=("impress", "probes", "h2o"))
    blend: bool = option(False, STORE, "blend marked documents (chat content parts, documents=[...], or parts "
                         "between --blend-separator in a plain prompt): their state computed alone is loaded at any "
                         "position and a few tokens recomputed (lossy, so off by default; a request's `blend` field "
                         "turns it off or asks for other options; docs/blend.md)")
    blend_mode: str = option("legolink", STORE, "with --blend: what is recomputed besides the new tokens: the first "
                             "--blend-link-tokens of each document (legolink), the --blend-ratio share of loaded "
                             "tokens whose keys deviate most at layer 2, weighed by the question's attention "
                             "(cacheblend), or nothing (naive)",
                             choices=("legolink", "cacheblend", "naive"))
    blend_link_tokens: int = option(8, STORE, "legolink: leading tokens of each document recomputed",
                                    type=non_negative_int, metavar="K")
    blend_ratio: float = option(0.15, STORE, "cacheblend: share of the loaded tokens recomputed", type=ratio,
                                metavar="R")
    blend_corpus: str | None = option(None, STORE, "with --blend: documents found in prompts that mark none, for "
                                      "every tenant (text files, one document each, or .jsonl files, one per line, "
                                      "as `kvtier precompile` reads them; comma-separated); their state is loaded "
                                      "from the store, or computed alone the first time", metavar="FILE[,FILE...]",
                                      default_text="none")
    eviction_policy: str = option("lru", STORE, "what the memory and disk tiers give up first; score: accesses x the "
                                  "share of a chunk importance restores needed, admitted to memory only above the "
                                  "lowest held", choices=("lru", "lfu", "fifo", "score"))
    importance_reorder_s: float = option(600.0, STORE, "impress: every S seconds, when the writer is idle, store the "
                                         "chunks importance restores have seen again with their tokens' K/V rows by "
                                         "importance, so the tokens a query keeps share granules (with --importance-unit "
                                         "token only); 0: never", type=non_negative, metavar="S")
    importance_alpha: float = option(0.6, STORE, "impress: probe heads agree when their Jaccard index is at least "
                                     "j**A, j that of two random sets", type=non_negative, metavar="A")

    partial_caching: str | None = option(None, PARTIAL, "let decoding requests keep KV for their newest tokens only and "
                                         "get the oldest back every step (recomputed, or from --front-swap-gb): "
                                         "optimizer chooses the batch size and each request's uncached front under "
                                         "--tpot-slo-ms; fixed uses --uncached-ratio",
                                         choices=("off", "optimizer", "fixed"),
                                         default_text="optimizer when --tpot-slo-ms is given, else off")
    tpot_slo_ms: float | None = option(None, PARTIAL, "time-per-output-token SLO in ms: the optimizer admits requests "
                                       "and sizes fronts so that decode steps, as the engine observes them, stay "
                                       "within 90% of it", type=positive_float, default_text="none")
    uncached_ratio: float = option(0.25, PARTIAL, "share of each decoding request's tokens left uncached with "
                                   "--partial-caching fixed", type=non_negative)
    front_swap_gb: float = option(0.0, PARTIAL, "host memory for uncached fronts, read back instead of recomputed "
                                  "where faster (GiB; 0: off)", type=non_negative)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        return cast(EngineOptions, from_args(cls, args))

    def impress(self) -> ImpressConfig:
        from kvtier.engine.config import ImportanceSelection, ImportanceUnit, ImpressConfig

        return ImpressConfig(ratio=self.importance_ratio, alpha=self.importance_alpha,
                             unit=ImportanceUnit(self.importance_unit), window=self.importance_window,
                             vote=self.importance_vote,
                             selection=ImportanceSelection(self.importance_selection),
                             reorder_s=self.importance_reorder_s)

    def reuse(self, **extra: Any) -> ReuseConfig:
        from kvtier.engine.config import EvictionPolicy, ReuseConfig
        from kvtier.store.seal import load_secret

        storage = "" if self.storage_dtype == "auto" else self.storage_dtype
        return ReuseConfig(method=self.restore_method, allow_lossy=self.allow_lossy, chunk_tokens=self.chunk_tokens,
                           storage_dtype=storage, min_restore_tokens=self.min_restore_tokens,
                           eviction_policy=EvictionPolicy(self.eviction_policy), impress=self.impress(),
                           seal=load_secret(self.store_secret, self.store_secret_file), blend=self.blend_options(),
                           **extra)

    def blend_options(self) -> BlendOptions | None:
        from kvtier.planning.blend import BlendOptions

        if not self.blend:
            for name, default in (("blend_mode", "legolink"), ("blend_link_tokens", 8), ("blend_ratio", 0.15),
                                  ("blend_corpus", None)):
                if getattr(self, name) != default:
                    raise ValueError(f"--{name.replace('_', '-')} sets how requests blend: add --blend")
            return None
        if self.no_store:
            raise ValueError("--blend loads documents' state from the store: drop --no-store")
        return BlendOptions(mode=self.blend_mode, link_tokens=self.blend_link_tokens, ratio=self.blend_ratio)

    def partial(self) -> PartialConfig | None:
        from kvtier.engine.config import PartialConfig, PartialPolicy

        policy = self.partial_caching or ("optimizer" if self.tpot_slo_ms is not None else "off")
        if policy == "off":
            if self.tpot_slo_ms is not None:
                raise ValueError("--tpot-slo-ms sets the partial-caching optimizer's SLO: drop --partial-caching off")
            return None
        return PartialConfig(policy=PartialPolicy(policy), ratio=self.uncached_ratio if policy == "fixed" else 0.0,
                             tpot_slo_s=self.tpot_slo_ms / 1e3 if self.tpot_slo_ms is not None else None,
                             swap_bytes=int(self.front_swap_gb * (1 << 30)))

    def engine_config(self) -> dict[str, Any]:
        """EngineConfig's fields (less the device, which `build_engine` resolves)."""
        kv = int(self.kv_cache_gb * (1 << 30)) if self.kv_cache_gb is not None else None
        return dict(max_model_len=self.max_model_len, kv_cache_bytes=kv, memory_utilization=self.gpu_memory_utilization,
                    static_decode=False if self.enforce_eager else None,
                    max_batched_tokens=self.max_batched_tokens, max_num_seqs=self.max_num_seqs,
                    enable_prefix_cache=not self.no_prefix_cache, partial=self.partial(), exact=not self.fast_inexact,
                    bf16_attention=self.bf16_attention, measure_when_idle=not self.no_idle_measuring)

    def build(self, reuse: ReuseConfig | None = None, measure_profile: bool = True, **config: Any) -> Engine:
        """Check the device and the store, load the model and build its engine (`config`:
        EngineConfig overrides; `measure_profile`: see `make_engine`)."""
        import torch

        from kvtier.engine.factory import build_engine

        if self.threads is not None:
            # Before the load: exact kernels' plans and the machine profile are made per thread count.
            torch.set_num_threads(check_threads(self.threads))
        asked = config.get("max_model_len", self.max_model_len)
        limit = model_context_limit(self.model)
        if asked is not None and limit is not None and asked > limit:
            raise ValueError(_too_long(asked, self.model, limit))
        engine = build_engine(self.model, dtype=self.dtype, device=self.device,
                              store=None if self.no_store else self.store, reuse=reuse or self.reuse(),
                              measure_profile=measure_profile, **{**self.engine_config(), **config})
        if asked is not None and engine.max_model_len < asked:  # a model whose limit shows only once loaded
            engine.close()
            raise ValueError(_too_long(asked, self.model, engine.max_model_len))
        if self.blend_corpus:
            try:
                load_corpus(engine, self.blend_corpus.split(","))
            except BaseException:
                engine.close()
                raise
        return engine


def load_corpus(engine: Engine, paths: list[str]) -> None:
    """--blend-corpus: the files' documents, tokenized, join the engine's corpus (every tenant's)."""
    from tqdm import tqdm

    from kvtier.cli.document_files import read_documents
    from kvtier.planning.blend import MIN_SEGMENT_TOKENS

    try:
        docs = read_documents([p.strip() for p in paths if p.strip()])
    except (OSError, ValueError) as e:
        raise ValueError(f"--blend-corpus: {e}") from None
    ids = [engine.encode(d) for d in tqdm(docs, desc="--blend-corpus", unit="doc", disable=None)]
    short = sum(len(i) < MIN_SEGMENT_TOKENS for i in ids)
    kept = engine.corpus.add(zip(docs, ids))
    log.info("--blend-corpus: %d documents to find in prompts (%d of %d read%s)", len(engine.corpus), kept, len(docs),
             f"; {short} under {MIN_SEGMENT_TOKENS} tokens left out: too short to load" if short else "")


def _too_long(asked: int, model: str, limit: int) -> str:
    return (f"--max-model-len {asked} is more than {model}'s context window of {limit} tokens "
            f"(max_position_embeddings): use at most {limit}, or leave it unset for the model's")


def model_context_limit(model: str) -> int | None:
    """The model's context window where it is known without loading it (a preset, a local Hugging
    Face directory); None for a Hub id or a GGUF file, whose limit the engine reports once loaded."""
    import json
    from pathlib import Path

    from kvtier.models.config import ModelConfig
    from kvtier.models.errors import ModelLoadError
    from kvtier.models.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    path = Path(model).expanduser()
    try:
        doc = json.loads((path / "config.json").read_text()) if path.is_dir() else None
    except (OSError, ValueError):
        return None  # the load names what is wrong with the directory
    try:
        return ModelConfig.from_hf(doc).max_position_embeddings if isinstance(doc, dict) else None
    except (ModelLoadError, ValueError, KeyError, TypeError):  # a config kvtier does not run: the load says so
        return None


# ----- flags -----------------------------------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --dtype and --device: what to load and where (every command that loads a model)."""
    add_options(p, EngineOptions, only=("model", "dtype", "device"), titles=TITLES)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the engine's budgets, the store, restores and partial caching."""
    add_options(p, EngineOptions, titles=TITLES)


def build_engine_from_args(args: argparse.Namespace, reuse: ReuseConfig | None = None, **config: Any) -> Engine:
    """Load the model and build its engine from the parsed options (`config`: EngineConfig overrides)."""
    return EngineOptions.from_args(args).build(reuse, **config)
