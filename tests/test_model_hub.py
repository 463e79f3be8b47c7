"""Model sources beyond a local directory: Hub ids through the local Hugging Face cache (offline, no
network in any test), sharded safetensors, and the GGUF conversion in the compute dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.models import gguf, hub
from kvtier.models.hub import HubId, HubSettings
from kvtier.models.loading import SMOLLM2_ARCHITECTURE, LoadedModel, ModelLoadError, load_model, smollm2_gguf_path
from kvtier.models.weights import INDEX, read_weights, weight_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a snapshot is named by its commit


def _tiny_llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(str(out))


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding org/tiny, laid out as huggingface_hub writes it."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / "models--org--tiny"
    _tiny_llama(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_cache(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the network was tried")

    monkeypatch.setattr(hub, "_download", no_network)
    return hf_cache


def _logits(m: LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return m.module(torch.arange(1, 17))


def test_hub_ids_parse():
    assert HubId.parse("org/name") == HubId("org/name")
    assert HubId.parse("HuggingFaceTB/SmolLM2-135M@v1.0") == HubId("HuggingFaceTB/SmolLM2-135M", "v1.0")
    assert str(HubId("a/b", "main")) == "a/b@main" and HubId("a/b", "r").download_command() == "hf download a/b --revision r"
    for not_an_id in ("name", "a/b/c", "./a/b", "/abs/path", "a/", "/a", "x.gguf"):
        assert HubId.parse(not_an_id) is None, not_an_id


def test_settings_follow_the_environment_at_call_time(tmp_path: Path):
    s = HubSettings.from_env({"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert s.cache_dir == tmp_path / "hub" and s.offline
    s = HubSettings.from_env({"HF_HOME": "/x", "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0"})
    assert s.cache_dir == tmp_path and s.timeout_s <= 10


def test_cached_hub_id_loads_offline_like_its_snapshot_dir(offline_cache: Path):
    snapshot = offline_cache / "models--org--tiny" / "snapshots" / COMMIT
    by_id = load_model("org/tiny", dtype="fp32", tokenizer=False)
    by_dir = load_model(str(snapshot), dtype="fp32", tokenizer=False)
    assert Path(by_id.source) == snapshot
    assert by_id.fingerprint == by_dir.fingerprint  # the same safetensors digests
    assert torch.equal(_logits(by_id), _logits(by_dir))
    assert load_model(f"org/tiny@{COMMIT}", dtype="fp32", tokenizer=False).fingerprint == by_id.fingerprint


def test_missing_hub_id_fails_offline_in_one_line(offline_cache: Path):
    with pytest.raises(ModelLoadError) as e:
        load_model("org/absent", dtype="fp32", tokenizer=False)
    msg = str(e.value)
    assert "\n" not in msg and "`hf download org/absent`" in msg and "HF_HUB_OFFLINE" in msg
    assert "HF_HOME" in msg and str(offline_cache) in msg
    with pytest.raises(ModelLoadError, match="--revision v2"):
        load_model("org/tiny@v2", dtype="fp32", tokenizer=False)  # cached, but not at that revision


def test_an_unreachable_hub_is_one_line_from_the_cli(tmp_path: Path):
    """Online but the Hub cannot be reached (here: an endpoint nobody listens on): `kvtier generate`
    exits 2 with one line saying what to run, before anything else is loaded."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=f"http://127.0.0.1:{port}",
               KVTIER_HOME=str(tmp_path / "home"))
    run = subprocess.run([sys.executable, "-m", "kvtier", "generate", "--model", "org/absent", "--prompt", "x",
                          "--no-store"], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: cannot download org/absent") and "`hf download org/absent`" in lines[0]


def test_a_local_directory_wins_over_a_hub_id(offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _tiny_llama(tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert load_model("org/tiny", dtype="fp32", tokenizer=False).source == "org/tiny"


def test_cached_models_lists_what_kvtier_runs(offline_cache: Path, tmp_path: Path):
    (offline_cache / "models--org--notes" / "snapshots" / COMMIT).mkdir(parents=True)  # no config: skipped
    found = hub.cached_models()
    assert [(m.repo_id, m.config.num_layers) for m in found] == [("org/tiny", 2)]
    assert hub.cached_models(HubSettings(tmp_path / "none", offline=True)) == []


def test_models_command_shows_cached_hub_models(offline_cache: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich would wrap the table to the default 80
    from kvtier.cli.main import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "org/tiny" in out and "hub (cached)" in out


def test_sharded_directory_loads_like_one_file(hf_cache: Path, tmp_path: Path):
    """Shards + index, as the GGUF conversion writes them (a tiny shard limit forces several)."""
    snapshot = hf_cache / "models--org--tiny" / "snapshots" / COMMIT
    out = tmp_path / "sharded"
    out.mkdir()
    plan = gguf.write_shards(gguf.SafetensorsSource(snapshot), torch.float32, out, limit=40_000)
    (out / "config.json").write_text((snapshot / "config.json").read_text())
    (out / "stray.safetensors").write_bytes(b"not listed in the index: never read")
    assert len(plan.shards) > 2 and all(len(s) for s in plan.shards)
    assert weight_files(out) == [out / plan.file_name(i) for i in range(len(plan.shards))]
    assert set(json.loads((out / INDEX).read_text())["weight_map"]) == set(read_weights(weight_files(snapshot)))
    a = load_model(str(out), dtype="fp32", tokenizer=False)
    b = load_model(str(snapshot), dtype="fp32", tokenizer=False)
    assert torch.equal(_logits(a), _logits(b))


def test_shard_plan_keeps_file_order_and_the_limit():
    plan = gguf.plan_shards([("a", 3), ("b", 3), ("c", 9), ("d", 1)], limit=6)
    assert plan.shards == (("a", "b"), ("c",), ("d",)) and plan.total_bytes == 16
    assert plan.file_name(0) == "model-00001-of-00003.safetensors"


@pytest.mark.slow
def test_gguf_conversion_is_transformers_fp32_cast_to_the_dtype(smollm2_fp32: LoadedModel, tmp_path: Path):
    """One transformers load as the reference. The session's fp32 conversion, a bf16 one streamed from the
    GGUF and a bf16 one cast from the fp32 directory: every tensor torch.equal to the reference cast."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = smollm2_gguf_path()
    assert path is not None
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).state_dict()
    ref.pop("lm_head.weight")  # tied to the embedding: not stored
    fp32_dir = Path(smollm2_fp32.source)
    assert fp32_dir.name.endswith("-float32") and json.loads((fp32_dir / "config.json").read_text())["dtype"] == "float32"
    streamed, cast = tmp_path / "streamed", tmp_path / "cast"
    streamed.mkdir()
    cast.mkdir()
    gguf.write_shards(gguf.GgufSource(path, AutoConfig.from_pretrained(str(fp32_dir))), torch.bfloat16, streamed)
    gguf.write_shards(gguf.SafetensorsSource(fp32_dir), torch.bfloat16, cast)
    for out, dtype in ((fp32_dir, torch.float32), (streamed, torch.bfloat16), (cast, torch.bfloat16)):
        got = read_weights(weight_files(out))
        assert sorted(got) == sorted(ref), out
        for k, v in got.items():
            assert v.dtype == dtype and torch.equal(v, ref[k].to(dtype)), (out, k)


@pytest.mark.slow
def test_the_tokenizer_read_once_is_autotokenizers(smollm2_fp32: LoadedModel, tmp_path: Path):
    """The tokenizer a preset takes from SmolLM2's GGUF (without parsing its config) and the one the
    conversion writes (parsing it once) are the one AutoTokenizer reads from the file: file for file,
    and a chat encodes alike."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    assert path is not None
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The config transformers read from the file when the session's model was converted.
    assert json.loads((Path(smollm2_fp32.source) / "config.json").read_text())["model_type"] == SMOLLM2_ARCHITECTURE
    got_dir = gguf.tokenizer_dir(path, tmp_path / "home", SMOLLM2_ARCHITECTURE)
    assert got_dir == gguf.GgufCache.of(path, tmp_path / "home").tokenizer
    got = AutoTokenizer.from_pretrained(str(got_dir))
    ref.save_pretrained(str(tmp_path / "ref"))
    got.save_pretrained(str(tmp_path / "got"))
    names = sorted(f.name for f in (tmp_path / "ref").iterdir())
    assert names == sorted(f.name for f in (tmp_path / "got").iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    # The conversion's tokenizer comes from the same call, behind the model type its config names.
    converted = gguf._tokenizer(path, SMOLLM2_ARCHITECTURE)
    converted.save_pretrained(str(tmp_path / "converted"))
    for name in names:
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    chat = [{"role": "user", "content": "Héllo, wörld! 12345 <tags> \n\ttabs"}]
    assert got.apply_chat_template(chat, tokenize=True) == ref.apply_chat_template(chat, tokenize=True)


@pytest.mark.slow
def test_second_conversion_reuses_the_cache(smollm2_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch):
    from kvtier import paths

    def no_work(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "write_shards", no_work)
    monkeypatch.setattr(gguf, "metadata_dir", no_work)
    path = smollm2_gguf_path()
    assert path is not None
    assert gguf.convert(path, paths.home(), torch.float32) == Path(smollm2_fp32.source)
