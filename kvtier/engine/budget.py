"""Per-device defaults: a step's token budget, the KV pool's size, and how decode steps run.

A CPU's step is bounded by compute: 2,048 tokens per step keeps a decode batch's step short while
a long prompt is prefilled beside it, and a 4 GiB pool costs nothing until its pages are used. A
GPU's step is bounded by launches and memory traffic: 16,384 tokens prefill a 16K prompt in one
step, as one HF forward does, and the pool takes what the device has left, as vLLM's
`--gpu-memory-utilization` does: that share of the device's memory, less what is in use now (the
weights), a step's activations at the token budget and two slots of a restore's staging ring for
a whole context (the ring never grows past them). Decode steps go through static buffers
and CUDA graphs on CUDA (engine/runner/backends/static.py); elsewhere they stay dynamic.
Anything set in `EngineConfig` wins over these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.config import EngineConfig
from kvtier.models.config import ModelConfig
from kvtier.planning.costs import READ_GROUP_LAYERS

CPU_STEP_TOKENS = 2048
GPU_STEP_TOKENS = 16384
CPU_KV_BYTES = 4 << 30
# Beyond the activations estimated below: the allocator's fragmentation, the CUDA graphs' pool,
# the CUDA context's own growth, the store's staging.
GPU_SLACK_BYTES = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


@dataclass(frozen=True)
class DeviceBudget:
    max_batched_tokens: int
    kv_cache_bytes: int
    static_decode: bool  # plain decode steps through static buffers (captured in CUDA graphs on CUDA)
    source: str  # how the pool was sized (the engine logs it)
    # Device memory a restore's staging ring may take (0: no limit; a CPU restore stages nothing).
    staging_bytes: int = 0


def device_memory(device: torch.device) -> DeviceMemory | None:
    """Total and free bytes of a CUDA device (None elsewhere: host memory is not reserved up front)."""
    if device.type != "cuda":
        return None
    # Blocks torch's allocator caches for this process (a closed engine's pool, say) count as used
    # in the driver's figure: handed back first, they are free for this budget.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free)


def step_activation_bytes(cfg: ModelConfig, itemsize: int, tokens: int, seqs: int) -> int:
    """A step's peak working memory at `tokens` tokens: per token the residual stream and its norm,
    q/k/v and attention output, the MLP's gate, up and product (in the compute dtype), and fp32
    logits for every sequence."""
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * (cfg.num_heads + cfg.num_kv_heads)
                 * cfg.head_dim) * itemsize
    return tokens * per_token + 2 * seqs * cfg.vocab_size * 4


def restore_staging_bytes(cfg: ModelConfig, itemsize: int, max_model_len: int) -> int:
    """Two slots of a restore's device staging ring (one copying while one is placed) for a whole
    context: a layer group's K and V of every chunk (groups of max(4, layers / 8) layers, as
    `engine.restore.layerwise` reads on an asynchronous device)."""
    group = max(READ_GROUP_LAYERS, -(-cfg.num_layers // 8))
    return 2 * group * 2 * cfg.kv_dim * itemsize * max_model_len


def step_tokens(config: EngineConfig, device: torch.device) -> int:
    """Prompt tokens one engine step computes at most: what `config` sets, else the device's default."""
    return config.max_batched_tokens or (GPU_STEP_TOKENS if device.type == "cuda" else CPU_STEP_TOKENS)


def choose(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
           memory: DeviceMemory | None = None) -> DeviceBudget:
    """The budget for `device`: what `config` sets, the device's defaults for the rest. `memory`:
    the device's memory now (measured when None)."""
    gpu = device.type == "cuda"
    tokens = step_tokens(config, device)
    static = config.static_decode if config.static_decode is not None else gpu
    staging = restore_staging_bytes(cfg, dtype.itemsize, max_model_len) if gpu else 0
    if config.kv_cache_bytes is not None:
        return DeviceBudget(tokens, config.kv_cache_bytes, static, "kv_cache_bytes", staging)
    memory = memory or device_memory(device)
    if memory is None:
        return DeviceBudget(tokens, CPU_KV_BYTES, static, "the CPU default")
    used = memory.total - memory.free  # the weights, and anything else already on the device
    cap = int(config.memory_utilization * memory.total)
    activations = step_activation_bytes(cfg, dtype.itemsize, tokens, config.max_num_seqs)
    kv = cap - used - activations - staging - GPU_SLACK_BYTES
    if kv <= 0:
        gib = 1 << 30
        raise ValueError(f"no device memory left for the KV pool: {config.memory_utilization:.0%} of "
                         f"{memory.total / gib:.1f} GiB is {cap / gib:.1f} GiB, {used / gib:.1f} GiB is in use "
                         f"(the weights), a {tokens}-token step needs ~{activations / gib:.1f} GiB and a "
                         f"restore's staging {staging / gib:.1f} GiB; raise --gpu-memory-utilization, lower "
                         f"--max-batched-tokens or --max-model-len, or set --kv-cache-gb")
    return DeviceBudget(tokens, kv, static, f"{config.memory_utilization:.0%} of device memory", staging)
