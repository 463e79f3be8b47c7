"""The batched sampler against its oracles: transformers' logits processors (repetition penalty,
temperature, top-k, top-p, min-p), OpenAI's presence/frequency formula written out, the grammar
engine's own mask, and the exponential race's draws against the distribution they sample."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvtier.engine.penalties import Seen
from kvtier.engine.request import GrammarSpec, SamplingParams
from kvtier.engine.sampler import Row, make_generator, process, sample_batch, warp
from kvtier.engine.structured import Grammars, apply_bitmask
from kvtier.models.loading import load_model

VOCAB = 300
CPU = torch.device("cpu")


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(prompt=(1, 2, 3), output=(), constraint=None, seen=None, **kw) -> Row:
    p = SamplingParams(**kw)
    return Row(p, make_generator(p, CPU), list(prompt), list(output), constraint, seen)


def test_repetition_penalty_equals_transformers():
    x = _logits(2)
    prompt, output = [4, 9, 9, 17], [250, 4, 33]
    got = process(x, [_row(prompt, output, repetition_penalty=1.3), _row(prompt, output)], ())
    ids = torch.tensor([prompt + output])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, x[:1].clone())
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], x[1])  # a row without penalties is left bit-for-bit alone


def test_presence_and_frequency_penalties_count_output_tokens_only():
    x = _logits(1)
    prompt, output = [7, 8], [8, 5, 5, 5]
    got = process(x, [_row(prompt, output, presence_penalty=0.5, frequency_penalty=0.25)], ())[0]
    want = x[0].clone()
    for t in set(output):
        want[t] -= 0.25 * output.count(t) + 0.5
    assert torch.allclose(got, want, atol=1e-6)
    assert got[7] == x[0, 7]  # prompt-only tokens are not penalized by these two


def test_logit_bias_and_min_tokens_and_stop_token_ids():
    x = _logits(2)
    rows = [_row(logit_bias={3: 5.0, 10: -100.0}), _row(output=[1], min_tokens=3, stop_token_ids=[42])]
    got = process(x, rows, stop_ids={0})
    assert torch.allclose(got[0, [3, 10]], x[0, [3, 10]] + torch.tensor([5.0, -100.0]))
    assert got[1, 0] == float("-inf") and got[1, 42] == float("-inf")  # EOS and stop ids held back
    free = process(x[1:], [_row(output=[1, 2, 3], min_tokens=3, stop_token_ids=[42])], stop_ids={0})
    assert torch.equal(free[0], x[1])  # min_tokens reached: nothing held back


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
])
def test_warpers_keep_the_tokens_and_probabilities_transformers_keeps(kw):
    x = _logits(3, seed=5)
    ids = torch.zeros(3, 1, dtype=torch.long)
    want = TemperatureLogitsWarper(kw["temperature"])(ids, x.clone())
    if "top_k" in kw:
        want = TopKLogitsWarper(kw["top_k"])(ids, want)
    if "top_p" in kw:
        want = TopPLogitsWarper(kw["top_p"])(ids, want)
    if "min_p" in kw:
        want = MinPLogitsWarper(kw["min_p"])(ids, want)
    for i in range(3):
        vals, ids = warp(x[i], SamplingParams(**kw))
        ids = torch.arange(VOCAB) if ids is None else ids
        kept = ids[torch.isfinite(vals)]
        assert set(kept.tolist()) == set(torch.isfinite(want[i]).nonzero().flatten().tolist())
        assert torch.allclose(torch.softmax(vals, -1)[torch.isfinite(vals)], torch.softmax(want[i], -1)[kept],
                              atol=1e-6)


def test_draws_follow_the_distribution():
    x = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]])).repeat(4000, 1)
    p = SamplingParams(seed=7)
    g = make_generator(p, CPU)
    tokens = [s.token for s in sample_batch(x, [Row(p, g, [], [])] * 4000, ())]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.double), atol=0.03)


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    x = _logits(6, seed=2)
    x[:] = x[3]  # every row the same logits: only the generators differ

    def draw(batch_seeds):
        rows = [_row(seed=s, temperature=1.5) for s in batch_seeds]
        return [s.token for s in sample_batch(x, rows, ())]

    alone = draw([11])[0]
    assert draw([3, 4, 11, 5])[2] == alone and draw([11, 1, 2, 3, 4, 5])[0] == alone
    assert len(set(draw(list(range(6))))) > 1  # different seeds do draw different tokens


def test_tiny_temperatures_are_stable_and_sample_the_argmax():
    x = _logits(2, seed=9)
    got = sample_batch(x, [_row(temperature=1e-30, seed=1), _row(temperature=1e-7, seed=2, top_p=1e-12)], ())
    assert [s.token for s in got] == x.argmax(-1).tolist()


def test_logprobs_are_the_raw_distribution():
    x = _logits(2, seed=4)
    got = sample_batch(x, [_row(logprobs=5, repetition_penalty=1.5, temperature=0.5), _row(logprobs=0)], ())
    lp = torch.log_softmax(x, -1)
    for i, s in enumerate(got):
        assert s.logprobs is not None and s.logprobs.token == s.token
        assert abs(s.logprobs.logprob - lp[i, s.token].item()) < 1e-6
    top = lp[0].topk(5)
    assert [t for t, _ in got[0].logprobs.top] == top.indices.tolist()
    assert got[1].logprobs.top == ()


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-gqa").tokenizer  # SmolLM2's


def test_the_grammar_mask_allows_only_what_the_matcher_allows(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer))
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"]}))
    c = grammars.constraint(spec)
    x = torch.zeros(1, len(tokenizer))
    got = process(x, [_row(constraint=c)], ())[0]
    allowed = torch.isfinite(got).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    c.accept(allowed[0])  # the mask moves with the matcher: a second "{" is no longer allowed
    again = torch.isfinite(process(x, [_row(constraint=c)], ())[0]).nonzero().flatten().tolist()
    assert again and not set(again) & set(allowed)


def test_penalties_kept_across_steps_equal_those_built_from_scratch():
    """The engine keeps each sequence's seen tokens across steps (penalties.Seen); adding tokens one
    by one gives bit for bit what a fresh build from the prompt and output gives."""
    x = _logits(1, seed=6)
    prompt, output = [4, 9, 9, 17, 250], [250, 4, 33, 33, 7]
    kw = dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    seen = Seen(prompt)
    for t in output:
        seen.add(t)
    kept = process(x, [_row(prompt, output, seen=seen, **kw)], ())
    assert torch.equal(kept, process(x, [_row(prompt, output, **kw)], ()))
    assert not torch.equal(kept, x)


def test_the_bitmask_is_applied_as_llguidance_applies_it():
    from llguidance.torch import apply_token_bitmask_inplace

    x = _logits(3, seed=11)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(2))
    ours, theirs = x.clone(), x.clone()
    apply_bitmask(ours, mask)
    apply_token_bitmask_inplace(theirs, mask)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any() and torch.isfinite(ours).any()
