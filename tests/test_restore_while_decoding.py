"""A context returning from the memory tier while another request decodes. On an asynchronous
device (here the lazy back end, which behaves like the worst legal one: copies deliver garbage
until waited on) its restore is prepared on the restore worker, so the decoding request's steps
carry none of it; on the CPU it stays in the decode's step. Either way the result is what a
recompute gives, bit for bit, for both requests."""

from __future__ import annotations

import threading

import pytest
import torch
from test_restore import GREEDY, HIST, _engine, _ids

from kvtier.engine.request import SamplingParams
from kvtier.engine.restore.layerwise import Restore
from kvtier.engine.runner.transfer import LazyTransfer


@pytest.mark.parametrize("device", ["async", "cpu"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_memory_restore_beside_a_decode_is_exact(dtype, device, monkeypatch):
    from kvtier.models.loading import load_model

    model = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    ids, other = _ids(model), _ids(model, seed=3)[:90]
    first = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, first_logits=True)
    ref = _engine(model, None)
    try:
        want_b = ref.generate([ids], first)[0]
        want_a = ref.generate([other], GREEDY)[0].output_ids
    finally:
        ref.close()

    laid_out: list[str] = []  # the threads that worked out where the restored rows go
    lay_out = Restore._lay_out

    def spy(self):
        laid_out.append(threading.current_thread().name)
        return lay_out(self)

    monkeypatch.setattr(Restore, "_lay_out", spy)
    if device == "async":
        monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda dev: LazyTransfer())
    engine = _engine(model, "memory:256MB", "kv")
    try:
        engine.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))  # saves the history
        assert engine.flush(30)
        a = engine.add_request(other, GREEDY)
        while not any(o.request_id == a and o.output_ids for o in engine.step()):
            pass  # "a" is decoding now
        b = engine.add_request(ids, first)
        outs, phases = {}, []
        while engine.has_work():
            for o in engine.step():
                outs[o.request_id] = o
            phases.append({r.request_id for r in engine.scheduler.restoring})
        if device == "async":  # b spent a step in the RESTORING phase while "a" decoded
            assert {b} in phases and len(laid_out) == 1 and laid_out[0].startswith("kvtier-restore"), laid_out
        else:  # prepared and placed in the decode's own step
            assert not any(phases) and laid_out == [threading.current_thread().name]
        got = outs[b]
        assert got.prompt_tokens_reused == HIST and got.restore_method == "kv"
        assert torch.equal(got.first_logits, want_b.first_logits)
        assert got.output_ids == want_b.output_ids and outs[a].output_ids == want_a
        assert engine.stats().counters["restore_failures"] == 0
    finally:
        engine.close()
