"""`kvtier.LLM`'s results in vLLM's shape (`vllm.outputs.RequestOutput` / `CompletionOutput`).

The engine reports each sample on its own (`kvtier.engine.engine.RequestOutput`, one per sample,
streamed); vLLM's offline API gives one RequestOutput per prompt whose `.outputs` hold its n
samples. `group` builds the latter from the former, so code written for `vllm.LLM`
(`outs[0].outputs[0].text`) runs on kvtier's. What kvtier measures beyond vLLM's fields (reuse by
tier, restore method, timings) stays on the request output, and the engine's own per-sample outputs
are kept in `engine_outputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.engine import RequestOutput as EngineOutput
from kvtier.engine.request import RestoreReport, SamplingParams
from kvtier.engine.sampler import TokenLogprobs


@dataclass
class Logprob:
    """One token's log probability, as vLLM's `vllm.sequence.Logprob`."""

    logprob: float
    rank: int | None = None  # 1 = the likeliest token of its distribution; None when not known
    decoded_token: str | None = None


# vLLM's SampleLogprobs / PromptLogprobs: per position, token id -> its Logprob (the chosen token and the k likeliest).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request, with vLLM's fields."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless SamplingParams(logprobs=...), as in vLLM
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # The stop token id or stop string that ended it; None for EOS, length, a finished grammar or an abort.
    stop_reason: int | str | None = None
    lora_request: None = None  # kvtier has no LoRA; kept so vLLM code that reads it runs

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, with vLLM's fields first, then kvtier's reuse figures.

    `prompt` is the text given (the rendered template for `LLM.chat`), None for a prompt given as
    token ids. `num_cached_tokens` counts the prompt tokens not computed: found in the device's
    prefix cache or restored from the store (kvtier's `prompt_tokens_reused`). With n > 1 the prompt
    is prefilled once and its samples forked, so the request-level figures are the first sample's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: None = None  # vLLM's RequestMetrics; kvtier's timings are the fields below
    lora_request: None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    # kvtier's own figures (the engine output's names).
    prompt_tokens: int = 0  # tokens that ran: fewer than prompt_token_ids when the engine truncated the prompt
    prompt_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    restore_method: str | None = None
    restore: RestoreReport | None = None
    queue_time: float | None = None
    ttft: float | None = None
    engine_outputs: list[EngineOutput] = field(default_factory=list)  # the engine's, one per sample, index order

    # The names a kvtier.LLM result had before it took vLLM's shape, for n == 1: they read the one sample.
    @property
    def text(self) -> str:
        return self._only().text

    @property
    def output_ids(self) -> list[int]:
        return self._only().output_ids

    @property
    def finish_reason(self) -> str | None:
        return self._only().finish_reason

    @property
    def mean_tbt(self) -> float | None:
        return self._only().mean_tbt

    def _only(self) -> EngineOutput:
        if len(self.engine_outputs) != 1:
            # An AttributeError, so hasattr() and getattr(..., default) behave as for a missing field.
            raise AttributeError(f"this request has {len(self.engine_outputs)} samples: read them from .outputs")
        return self.engine_outputs[0]


def group(samples: Sequence[EngineOutput], prompts: Sequence[str | None], prompt_ids: Sequence[list[int]],
          params: SamplingParams, tokenizer: Any | None, eos_ids: Sequence[int]) -> list[RequestOutput]:
    """The engine's finished outputs of `prompts` (n per prompt, in prompt then index order, as
    `Engine.generate` returns them) as one RequestOutput per prompt."""
    n = params.n
    if len(samples) != n * len(prompts):
        raise ValueError(f"{len(samples)} outputs for {len(prompts)} prompts of n={n}")
    text_of = _token_text(tokenizer)
    results = []
    for p, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        outs = list(samples[p * n:(p + 1) * n])
        first = outs[0]
        results.append(RequestOutput(
            request_id=first.request_id,  # sample 0 carries the request's own id; the others `<id>#<i>`
            prompt=prompt,
            prompt_token_ids=list(ids),
            prompt_logprobs=_prompt_logprobs(first.prompt_logprobs, text_of),
            outputs=[_completion(o, params, tokenizer, eos_ids, text_of) for o in outs],
            finished=all(o.finished for o in outs),
            num_cached_tokens=first.prompt_tokens_reused,
            prompt_tokens=first.prompt_tokens,
            prompt_tokens_reused=first.prompt_tokens_reused,
            prompt_tokens_computed=first.prompt_tokens_computed,
            reused_by_tier=dict(first.reused_by_tier),
            restore_method=first.restore_method,
            restore=first.restore,
            queue_time=first.queue_time,
            ttft=first.ttft,
            engine_outputs=outs,
        ))
    return results


def _completion(out: EngineOutput, params: SamplingParams, tokenizer: Any | None, eos_ids: Sequence[int],
                text_of: Callable[[int], str | None]) -> CompletionOutput:
    logprobs = [_step(lp, text_of) for lp in out.logprobs] if out.logprobs is not None else None
    return CompletionOutput(
        index=out.index,
        text=out.text,
        token_ids=list(out.output_ids),
        cumulative_logprob=sum(lp.logprob for lp in out.logprobs) if out.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=_stop_reason(out, params, tokenizer, eos_ids),
    )


def _stop_reason(out: EngineOutput, params: SamplingParams, tokenizer: Any | None,
                 eos_ids: Sequence[int]) -> int | str | None:
    """What vLLM puts in stop_reason, found again from the finished output: the engine ends on EOS
    and stop_token_ids before it looks for stop strings, and it keeps the ending token in output_ids."""
    if out.finish_reason != "stop" or not out.output_ids:
        return None
    last = out.output_ids[-1]
    if last in eos_ids and not params.ignore_eos:
        return None  # EOS: vLLM reports None
    if last in params.stop_token_ids:
        return last
    if not params.stop or tokenizer is None:
        return None
    # A stop string: the text ends where it began, so the decode of the whole output goes on with it.
    # The engine tries the strings in the order given and takes the first found; so does this.
    rest = str(tokenizer.decode(out.output_ids, skip_special_tokens=True))[len(out.text):]
    return next((s for s in params.stop if s in rest), None)


def _step(lp: TokenLogprobs, text_of: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's logprobs as vLLM's dict: the k likeliest by rank, and the chosen token."""
    step = {tok: Logprob(value, i + 1, text_of(tok)) for i, (tok, value) in enumerate(lp.top)}
    rank = lp.rank if lp.rank is not None else (step[lp.token].rank if lp.token in step else None)
    step[lp.token] = Logprob(lp.logprob, rank, text_of(lp.token))
    return step


def _prompt_logprobs(lps: Sequence[TokenLogprobs | None] | None,
                     text_of: Callable[[int], str | None]) -> PromptLogprobs | None:
    if lps is None:
        return None
    return [_step(lp, text_of) if lp is not None else None for lp in lps]


def _token_text(tokenizer: Any | None) -> Callable[[int], str | None]:
    """A token's text alone (vLLM's decoded_token), decoded once per token id."""
    cache: dict[int, str | None] = {}

    def text_of(token: int) -> str | None:
        if token not in cache:
            cache[token] = str(tokenizer.decode([token])) if tokenizer is not None else None
        return cache[token]
    return text_of
