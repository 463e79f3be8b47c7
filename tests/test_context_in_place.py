"""Exact CPU attention reads a context as whole 512-key blocks. Where the pool slots past a
context's end hold nothing anyone reads (`BlockPool.clearable`), the runner zeroes them and reads
the context in place instead of copying it into a padded buffer every layer: the logits must be the
same bits, whatever those slots held before (uninitialised pool memory may be NaN)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.models.loading import load_model

BS = 16


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_context_read_in_place_past_its_end_gives_the_padded_copys_bits(dtype):
    lm = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    ids = torch.randint(100, lm.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(40))  # 640 slots: the 600 tokens, then own slots no token reached
    out = {}
    for name, clearable in (("copied", None), ("in place", lambda run, slots: True)):
        runner = ModelRunner(lm.module, 72, BS, 1024)  # key_rows(600) = 1024 slots: 24 clean blocks past its own
        runner.clearable = clearable
        for cache in (runner.k_cache, runner.v_cache):
            cache[:, : runner.sink] = float("nan")  # what a slot may hold before it is written
        runner.execute([RunItem(ids[:520], 0, blocks, want_logits=False)])
        step = [RunItem(ids[520:], 520, blocks, want_logits=True)]
        batch = runner.prepare(step)
        assert (batch.tails[0] is not None) == (clearable is not None)
        assert (batch.pads[0] is None) == (clearable is not None)  # no per-layer copy where in place
        if clearable is not None:
            assert batch.tails[0] == range(600, 1024) and batch.ctx[0] == range(0, 1024)
        out[name] = runner.execute(step)
        assert torch.isfinite(out[name]).all()
    assert torch.equal(out["copied"], out["in place"])
