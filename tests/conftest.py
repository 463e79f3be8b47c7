"""Shared fixtures: random-weight configs for the oracle tests and the real smollm2 model."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvtier.models.config import ModelConfig, RopeScaling
from kvtier.models.loading import LoadedModel, _build, load_model
from kvtier.models.presets import PRESETS, random_state_dict

torch.set_num_threads(2)


def _tiny(**kw) -> ModelConfig:
    base = dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=3,
        num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=1024, eos_token_ids=(2,),
    )
    base.update(kw)
    return ModelConfig(**base)


ORACLE_CONFIGS = {
    "llama-mha": _tiny(),
    "llama-gqa": _tiny(num_kv_heads=2, tie_word_embeddings=True),
    "llama3-rope-scaling": _tiny(
        num_kv_heads=1, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    ),
    "llama-linear-rope": _tiny(rope_scaling=RopeScaling(kind="linear", factor=2.0)),
    "mistral": _tiny(model_type="mistral", num_kv_heads=2),
    "qwen2-bias": _tiny(model_type="qwen2", num_kv_heads=2, qkv_bias=True, head_dim=16),
}


def build_pair(cfg: ModelConfig, seed: int = 0):
    """Our module and an HF transformers model holding the same fp32 weights."""
    import transformers

    state = random_state_dict(cfg, seed)
    if cfg.tie_word_embeddings:  # one shared matrix: the embedding
        state.pop("lm_head.weight")
    ours = _build(cfg, dict(state), torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not [k for k in missing if k != "lm_head.weight"] and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return ours, hf.eval()


def loaded(cfg: ModelConfig, module, name: str = "test") -> LoadedModel:
    return LoadedModel(name, cfg, module, None, f"test-{cfg.digest()[:8]}", "test")


@pytest.fixture(scope="session")
def smollm2_fp32() -> LoadedModel:
    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_gqa() -> LoadedModel:
    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


@pytest.fixture(scope="session")
def tiny_mha() -> LoadedModel:
    return load_model("tiny-mha", dtype="fp32", tokenizer=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a fresh redis-server on a free loopback port (skipped only if the binary is missing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (CI installs it from Debian packages)")
    import redis

    workdir = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        else:
            proc.kill()
            continue
        if proc.poll() is None:
            break
    else:
        pytest.fail("could not start redis-server")
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_url(redis_server, request):
    """A per-test key prefix on the shared server, so tests do not see each other's chunks."""
    import redis

    prefix = "t" + str(abs(hash(request.node.nodeid)) % 10**10)
    yield f"{redis_server}/0?prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    for k in client.scan_iter(match=f"{prefix}:*"):
        client.delete(k)
