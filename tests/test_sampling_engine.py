"""The engine's sampling features end to end (issue 29): logprobs against the HF oracle for a
recomputed and a restored prompt, n > 1 samples that share one prefill and still equal their
single runs bit for bit in bf16, and structured output that always parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.grammar_limits import GrammarLimits
from kvtier.engine.request import GrammarSpec, SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model

from kvtier_testlib import ORACLE_CONFIGS, build_pair, fake_profile, loaded


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    """Requests with their own parameters, batched together; final outputs in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final: dict[str, RequestOutput] = {}
    while len(final) < len(ids):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[i] for i in ids]


def test_logprobs_equal_the_hf_oracle_recomputed_and_restored(tmp_path):
    cfg = ORACLE_CONFIGS["llama-gqa"]
    ours, hf = build_pair(cfg)
    model = loaded(cfg, ours)
    prompt = torch.randint(3, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=4, ignore_eos=True)
    store = f"disk:{tmp_path}/s:1GB"
    reuse = ReuseConfig(method="kv", chunk_tokens=16)
    prof = fake_profile(model.fingerprint)
    with Engine(model, EngineConfig(kv_cache_bytes=8 << 20), store=store, reuse=reuse, profile=prof) as first:
        computed = first.generate([prompt], params)[0]
    with Engine(model, EngineConfig(kv_cache_bytes=8 << 20, enable_prefix_cache=False), store=store, reuse=reuse,
                profile=prof) as second:
        restored = second.generate([prompt], params)[0]
    assert restored.prompt_tokens_reused >= 64 and computed.prompt_tokens_reused == 0
    seq = prompt + computed.output_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1], dim=-1)  # [5, vocab]
    for out in (computed, restored):
        assert out.output_ids == computed.output_ids and out.logprobs is not None
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[step, lp.token].item()) <= 1e-4
            top = ref[step].topk(4)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(lp.top, top.values.tolist())) <= 1e-4


def test_prompt_logprobs_equal_the_hf_oracle_even_where_the_prompt_is_stored(tmp_path):
    """A prompt the store holds is computed in full when its logprobs are asked for (a restored
    token has no logits), in chunks; the values and ranks are the oracle's."""
    cfg = ORACLE_CONFIGS["llama-gqa"]
    ours, hf = build_pair(cfg)
    model = loaded(cfg, ours)
    prompt = torch.randint(3, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    store, reuse, prof = f"disk:{tmp_path}/s:1GB", ReuseConfig(method="kv", chunk_tokens=16), fake_profile(
        model.fingerprint)
    config = EngineConfig(kv_cache_bytes=8 << 20, max_batched_tokens=32)  # the prompt in three chunks
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    with Engine(model, config, store=store, reuse=reuse, profile=prof) as first:
        first.generate([prompt], greedy)
    with Engine(model, config, store=store, reuse=reuse, profile=prof) as second:
        scored = second.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
        assert second.generate([prompt], greedy)[0].prompt_tokens_reused >= 64  # without them: restored
    assert scored.prompt_tokens_reused == 0 and scored.prompt_logprobs is not None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)  # [70, vocab]
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    for i, lp in enumerate(scored.prompt_logprobs[1:], start=1):
        assert lp.token == prompt[i] and abs(lp.logprob - ref[i - 1, prompt[i]].item()) <= 1e-4
        assert lp.rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == ref[i - 1].topk(3).indices.tolist()


@pytest.fixture(scope="module")
def tiny_bf16():
    return load_model("tiny-gqa", dtype="bfloat16")


@pytest.mark.parametrize("prompt_len", [21, 32])  # a partial last block to copy, and none
def test_n_samples_share_one_prefill_and_equal_their_single_runs_in_bf16(tiny_bf16, prompt_len):
    prompt = torch.randint(3, 4000, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    base = dict(max_tokens=6, temperature=1.5, logprobs=3, ignore_eos=True)
    engine = Engine(tiny_bf16, EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256))
    samples = engine.generate([prompt], SamplingParams(n=3, seed=5, **base))
    assert [o.index for o in samples] == [0, 1, 2]
    assert [o.prompt_tokens_computed for o in samples] == [prompt_len, 0, 0]  # one prefill
    assert engine.pool.num_free == engine.pool.num_blocks  # every shared or copied block came back
    for i, out in enumerate(samples):
        alone = Engine(tiny_bf16, EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256)).generate(
            [prompt], SamplingParams(seed=5 + i, **base))[0]
        assert out.output_ids == alone.output_ids
        assert [(x.token, x.logprob, x.top) for x in out.logprobs] == \
               [(x.token, x.logprob, x.top) for x in alone.logprobs]  # bit-identical floats


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "ok": {"type": "boolean"}},
     "required": ["point", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["kind", "n"], "additionalProperties": False}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 10000},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"active": {"type": "boolean"},
                                                  "note": {"type": ["string", "null"], "maxLength": 8}},
                 "required": ["active", "note"], "additionalProperties": False}},
        "required": ["id", "roles", "meta"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_fifty_sampled_generations_follow_the_json_schema(schema):
    """A random-weight model (it never means to write JSON) at temperature 1, 50 seeds."""
    engine = Engine(load_model("tiny-gqa"), EngineConfig(kv_cache_bytes=32 << 20, max_model_len=512))
    spec = GrammarSpec("json_schema", json.dumps(schema))
    prompt = engine.encode("Answer in JSON:")
    outs = _run(engine, [(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=s, structured=spec))
                         for s in range(50)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced answer


def test_structured_multi_sample_requests_save_and_restore_like_any_other(tmp_path):
    """n = 2 with a JSON schema and logprobs: the prompt is saved, restored by a fresh engine from
    disk, and every sample comes out bit-identical to the run that computed it."""
    model = load_model("tiny-gqa", dtype="bfloat16")
    prompt = torch.randint(3, 4000, (90,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(n=2, seed=4, temperature=1.0, logprobs=2, max_tokens=60,
                            structured=GrammarSpec("json_schema", json.dumps(SCHEMAS[1])))
    store, reuse, prof = f"disk:{tmp_path}/s:1GB", ReuseConfig(method="kv", chunk_tokens=16), fake_profile(
        model.fingerprint)
    with Engine(model, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=512), store=store, reuse=reuse,
                profile=prof) as first:
        computed = first.generate([prompt], params)
    with Engine(model, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=512, enable_prefix_cache=False),
                store=store, reuse=reuse, profile=prof) as second:
        restored = second.generate([prompt], params)
    assert restored[0].reused_by_tier.get("disk", 0) >= 80
    for a, b in zip(computed, restored):
        assert a.text == b.text and [(x.token, x.logprob) for x in a.logprobs] == [(x.token, x.logprob) for x in b.logprobs]
        jsonschema.validate(json.loads(b.text), SCHEMAS[1])


def test_a_sample_with_no_free_block_waits_and_prefills_itself(tiny_bf16):
    """A pool of exactly one sequence: the second sample cannot take a block for its copy, so it
    waits, prefills from the published prefix once the first ends, and still equals its single run."""
    block_bytes = ModelRunner.bytes_per_block(tiny_bf16.module, 16)
    config = EngineConfig(kv_cache_bytes=2 * block_bytes, max_model_len=32)
    prompt = torch.randint(3, 4000, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    base = dict(max_tokens=4, temperature=1.5, logprobs=1, ignore_eos=True)
    engine = Engine(tiny_bf16, config)
    first, second = engine.generate([prompt], SamplingParams(n=2, seed=9, **base))
    assert second.prompt_tokens_computed > 0 and second.prompt_tokens_reused == 16  # its own prefill
    alone = Engine(tiny_bf16, config).generate([prompt], SamplingParams(seed=10, **base))[0]
    assert second.output_ids == alone.output_ids
    assert [x.logprob for x in second.logprobs] == [x.logprob for x in alone.logprobs]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_grammar_that_fails_mid_sequence_aborts_and_ids_may_not_name_samples():
    """A grammar llguidance compiles but cannot follow (over its limits) ends the request as an
    error, never as a "stop" whose text would look complete; '#' is kept for n > 1 sample ids."""
    engine = Engine(load_model("tiny-gqa"), EngineConfig(kv_cache_bytes=16 << 20, max_model_len=256))
    engine.grammars.limits = GrammarLimits(max_repeat=10**9)  # past the default limits, which refuse it
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                                      structured=GrammarSpec("regex", "a{99999999}")))[0]
    assert out.finish_reason == "abort" and out.error is not None and "grammar engine" in out.error
    assert engine.pool.num_free == engine.pool.num_blocks
    with pytest.raises(ValueError, match="'#'"):
        engine.add_request([5, 6], request_id="mine#1")


def test_samples_keep_to_the_batch_cap(tiny_bf16):
    engine = Engine(tiny_bf16, EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256, max_num_seqs=2))
    for seed in range(3):
        engine.add_request([5, 17, 301, 42, 9] * 4, SamplingParams(n=3, seed=seed, max_tokens=4, temperature=1.0))
    finished = 0
    while engine.has_work():
        finished += sum(o.finished for o in engine.step())
        assert len(engine.scheduler.running) + len(engine.scheduler.restoring) <= 2
    assert finished == 9 and engine.pool.num_free == engine.pool.num_blocks
