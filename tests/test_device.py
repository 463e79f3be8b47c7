"""The device-generic code, checked on a CPU-only machine (CI): the `--device cuda` error, a fake
CUDA model through a step, restore placements and a save (every tensor it meets must be on the
device), and the lazy transfer back end under which every restore method still equals recompute,
while a restore or a save that skips a wait is caught."""

from __future__ import annotations

import subprocess
import sys

import pytest
import test_restore
import torch
from test_restore import GREEDY, HIST, _engine, _ids, check_all_methods, restore_after_saving

from kvtier.device import DeviceError, resolve_device
from kvtier.engine.link.saver import Saver
from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.engine.runner.transfer import DONE, LazyTransfer, Transfer
from kvtier.models.llama import CausalLM
from kvtier.models.presets import PRESETS
from kvtier.store.layout import Repr

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@no_cuda
def test_cuda_on_a_cpu_machine_is_a_one_line_error():
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="auto, cpu, cuda"):
        resolve_device("tpu")
    run = subprocess.run([sys.executable, "-m", "kvtier", "generate", "--model", "tiny-gqa", "--device", "cuda",
                          "--prompt", "hi", "--no-store"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: device 'cuda': no CUDA GPU"), run.stderr


# ----- a data-less device -------------------------------------------------------------------------
# FakeTensorMode cannot index a fake CUDA tensor with Python slices on a CPU-only build ("not linked
# with support for cuda devices"), so the step runs on the `meta` device instead: no data, and an
# op mixing a host tensor with a meta tensor raises, as it would crash on a GPU.
def _meta_model(name: str = "tiny-gqa") -> CausalLM:
    with torch.device("meta"):
        return CausalLM(PRESETS[name]).eval()


def test_host_tensors_meeting_device_tensors_raise_on_meta():
    """The check below can fail: host slots into the pool, a host mask or RoPE table are caught
    (meta is lenient only with host indices to index_select and embedding)."""
    pool = torch.empty(4, 3, device="meta")
    with pytest.raises(RuntimeError, match="same device"):
        pool.index_copy_(0, torch.tensor([1]), torch.empty(1, 3, device="meta"))
    with pytest.raises(RuntimeError, match="expected device meta"):
        pool * torch.ones(4, 3)


class _MetaTransfer(Transfer):
    def to_host(self, src):  # meta tensors hold no data to copy out: empty host tensors stand in
        return [torch.empty(t.shape, dtype=t.dtype) for t in src], DONE


def test_a_device_model_steps_places_and_saves_on_the_device():
    """Any host tensor meeting a device tensor (ids, positions, slots, masks, RoPE tables, restored
    K/V, hidden states to project) raises, as it would crash on a GPU."""
    dev = torch.device("meta")
    with torch.inference_mode():
        model = _meta_model()
        cfg = model.cfg
        runner = ModelRunner(model, 16, 16, 256, transfer=_MetaTransfer(dev))
        assert runner.k_cache.device == dev and runner.rope.cos_h.device == dev
        captured = []
        capture = lambda li, offsets, h, k, v: captured.append((h, k, v))  # noqa: E731
        # A fresh prefill, a chunk continuing a history (gathered: blocks not consecutive), two decodes.
        logits = runner.execute([RunItem(list(range(5, 45)), 0, [0, 1, 2], True),
                                 RunItem(list(range(5, 25)), 20, [3, 5, 6], True)], capture=capture)
        assert logits.device == dev and logits.shape == (2, cfg.vocab_size)
        assert all(t.device == dev for c in captured for t in c)
        logits = runner.execute([RunItem([7], 40, [0, 1, 2], True), RunItem([8], 40, [3, 5, 6], True)])
        assert logits.device == dev
        # Restore placements from host tensors (what store reads return).
        k = torch.randn(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
        runner.copy_in(range(cfg.num_layers), [(96, 16)], [k], [k.clone()])
        (h,), _ = runner.transfer.stage([torch.randn(16, cfg.hidden_size)])
        runner.project_in(1, h, (0, 16), runner.upload(runner.slots(list(range(16)), 96, 112)))
        (ks, vs), _ = runner.transfer.stage([k[0], k[1]])
        runner.shift_in(2, ks, vs, runner.upload(torch.full((16,), 3)), runner.upload(runner.slots(list(range(16)), 96, 112)))
        assert runner.k_cache.device == dev
        # A save: the saver snapshots pool blocks and hidden states into host tensors only.
        saver = Saver(store=None, layout=(Repr.KV, Repr.HIDDEN) * (cfg.num_layers // 2), chunk_tokens=64,  # type: ignore[arg-type]
                      runner=runner)
        req = Request("r", list(range(5, 45)), SamplingParams())
        cap = saver.capture_for([req])
        runner.execute([RunItem(list(range(5, 45)), 0, [0, 1, 2], True)], capture=cap)
        req.block_ids, req.num_computed = [0, 1, 2], 40
        saver.after_step(req, finished=False)
        buf = saver.buffers["r"]
        held = [p[2] for p in buf.kv + buf.h]
        assert held and all(t.device.type == "cpu" for t in held)
        assert [p[:2] for p in buf.kv] == [(0, 32)] and [p[:2] for p in buf.h] == [(0, 40)]


# ----- a lazy transfer back end -------------------------------------------------------------------
@pytest.fixture
def lazy(monkeypatch):
    """Every engine built in the test gets a LazyTransfer: copies deliver NaN until waited on."""
    monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: LazyTransfer())


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_every_method_equals_recompute_under_a_lazy_transfer(lazy, tiny_gqa, tmp_path, tier):
    spec = "memory:256MB" if tier == "memory" else f"disk:{tmp_path}/d:1GB"
    check_all_methods(tiny_gqa, spec)


class _NoComputeWait(LazyTransfer):
    def wait(self, handle):  # the compute stream does not wait: copies land after the step
        pass

    def sync(self, handle):
        LazyTransfer.wait(self, handle)


class _NoSaveSync(LazyTransfer):
    def sync(self, handle):  # the writer does not wait for the device-to-host copies
        pass


@pytest.mark.parametrize("broken", [_NoComputeWait, _NoSaveSync])
def test_the_lazy_back_end_catches_a_missing_wait(monkeypatch, tiny_gqa, broken):
    monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: broken())
    ids = _ids(tiny_gqa)
    ref = _engine(tiny_gqa, None).generate([ids], GREEDY)[0].output_ids
    out = restore_after_saving(_engine(tiny_gqa, "memory:256MB", "kv"), ids)
    assert out.prompt_tokens_reused == HIST
    assert out.output_ids != ref  # computed on NaN: the missing wait shows without a GPU


def test_the_device_cached_prefix_is_never_written_under_a_lazy_transfer(lazy, tiny_gqa, tmp_path):
    test_restore.test_restore_after_a_device_cached_prefix_never_writes_it(tiny_gqa, tmp_path, "kv")
