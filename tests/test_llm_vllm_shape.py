"""`kvtier.LLM` answers in vLLM's shape: one RequestOutput per prompt with its samples in `.outputs`
(CompletionOutput), so code written for `vllm.LLM` reads kvtier's results unchanged. The oracle is
a plain Engine running the same request: the wrapper must carry its tokens, text and reasons as they are."""

from __future__ import annotations

import pytest

from kvtier import LLM, Engine, SamplingParams, load_model
from kvtier.outputs import CompletionOutput, Logprob, RequestOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
MSGS = [{"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-gqa", dtype="fp32", no_store=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def oracle():
    with Engine(load_model("tiny-gqa", dtype="fp32")) as engine:
        yield engine


def test_generate_gives_request_outputs_with_completion_outputs(llm, oracle):
    outs = llm.generate(["hello there", [5, 6, 7]], GREEDY)
    want = oracle.generate(["hello there", [5, 6, 7]], GREEDY)
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    assert [o.prompt for o in outs] == ["hello there", None]  # token ids have no text, as in vLLM
    assert outs[0].prompt_token_ids == oracle.encode("hello there") and outs[1].prompt_token_ids == [5, 6, 7]
    for o, w in zip(outs, want):
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert (c.text, c.token_ids, c.finish_reason) == (w.text, w.output_ids, w.finish_reason)
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.cumulative_logprob is None and c.logprobs is None and o.prompt_logprobs is None
        assert o.num_cached_tokens == o.prompt_tokens_reused == w.prompt_tokens_reused
    assert outs[0].request_id != outs[1].request_id


def test_a_lone_prompt_still_gives_a_list(llm):
    outs = llm.generate("hello there", GREEDY)
    assert len(outs) == 1 and outs[0].prompt == "hello there"
    assert len(llm.generate([5, 6, 7], GREEDY)) == 1  # one prompt of token ids, not three prompts


def test_n_samples_of_a_prompt_are_one_request_output(llm, oracle):
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3)
    outs = llm.generate(["hello there", [5, 6, 7]], params)
    want = oracle.generate(["hello there", [5, 6, 7]], params)  # the engine's: n outputs per prompt, flat
    assert len(outs) == 2
    for o, ws in zip(outs, (want[:2], want[2:])):
        assert [c.index for c in o.outputs] == [0, 1]
        assert [c.token_ids for c in o.outputs] == [w.output_ids for w in ws]
        assert [c.text for c in o.outputs] == [w.text for w in ws]
        assert "#" not in o.request_id  # the request's own id, not a sample's
        assert len(o.engine_outputs) == 2


def test_logprobs_in_vllm_form(llm, oracle):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1)
    c = (o := llm.generate([5, 6, 7, 8], params)[0]).outputs[0]
    w = oracle.generate([5, 6, 7, 8], params)[0]
    assert w.logprobs is not None and c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in w.logprobs))
    for step, tok, lp in zip(c.logprobs, c.token_ids, w.logprobs):
        assert isinstance(step[tok], Logprob) and step[tok].logprob == pytest.approx(lp.logprob)
        assert step[tok].rank == 1  # greedy: the sampled token is the likeliest
        assert {t for t, _ in lp.top} <= set(step)
        assert all(isinstance(v.decoded_token, str) for v in step.values())
    assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == 4 and o.prompt_logprobs[0] is None
    assert all(6 + i in step for i, step in enumerate(o.prompt_logprobs[1:]))  # type: ignore[operator]


def test_stop_reason_names_the_stop_token_or_string(llm, oracle):
    first = oracle.generate("hello there", SamplingParams(max_tokens=8, temperature=0.0))[0]
    by_token = llm.generate("hello there", SamplingParams(max_tokens=8, temperature=0.0,
                                                          stop_token_ids=(first.output_ids[0],)))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", first.output_ids[0])
    stop = first.text.strip()[-2:]
    assert stop
    by_string = llm.generate("hello there", SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,)))[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    assert stop not in by_string.text and first.text.startswith(by_string.text)


def test_chat_is_vllm_shaped(llm, oracle):
    outs = llm.chat(MSGS, GREEDY)  # vLLM's LLM.chat: a list, also for one conversation
    want = oracle.generate([oracle.encode_chat(MSGS)], GREEDY)[0]
    assert len(outs) == 1
    o = outs[0]
    assert o.prompt_token_ids == oracle.encode_chat(MSGS)
    assert isinstance(o.prompt, str) and "Hi there!" in o.prompt  # the rendered template
    assert (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) == \
        (want.text, want.output_ids, want.finish_reason)
    both = llm.chat([MSGS, MSGS], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1))
    assert len(both) == 2 and [[c.index for c in b.outputs] for b in both] == [[0, 1], [0, 1]]


def test_a_vllm_snippet_runs(llm, capsys):
    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4)
    for output in llm.generate(prompts, params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["Prompt: 'Hello", "Prompt: 'The capital of France is'"]


def test_reuse_figures_and_the_old_names_stay(llm, oracle):
    ids = [3 + (i * 7) % 400 for i in range(100)]
    llm.generate([ids], GREEDY)
    o = llm.generate([ids], GREEDY)[0]  # the device prefix cache holds the first run's blocks
    assert o.num_cached_tokens == o.prompt_tokens_reused > 0
    assert o.prompt_tokens_computed == len(ids) - o.prompt_tokens_reused
    assert isinstance(o.reused_by_tier, dict) and o.ttft is not None and o.queue_time is not None
    assert o.restore_method is None or isinstance(o.restore_method, str)
    # n == 1: the names kvtier's own output had still read the one sample
    want = oracle.generate([ids], GREEDY)[0]
    assert (o.text, o.output_ids, o.finish_reason, o.prompt_tokens) == \
        (want.text, want.output_ids, want.finish_reason, len(ids))
    assert o.engine_outputs[0].output_ids == want.output_ids
    two = llm.generate([ids], SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1))[0]
    with pytest.raises(AttributeError, match="outputs"):
        _ = two.text


def test_generate_takes_vllms_priority_list(llm, monkeypatch):
    """One sequence at a time, the lowest value is admitted first (the shortest queue time), equal
    values in prompt order; the outputs stay in prompt order, their answers unchanged."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]]
    plain = llm.generate(prompts, GREEDY)
    monkeypatch.setattr(llm.engine.scheduler, "max_num_seqs", 1)
    outs = llm.generate(prompts, GREEDY, priority=[2, 0, 1, 0])
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert sorted(range(len(outs)), key=lambda i: outs[i].queue_time or 0.0) == [1, 3, 2, 0]
