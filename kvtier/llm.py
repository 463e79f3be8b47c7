"""`kvtier.LLM`: the short way in from Python, in the shape of vLLM's offline `LLM`.

    from kvtier import LLM, SamplingParams

    with LLM("smollm2-135m", store="memory:1GB") as llm:
        for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=8)):
            print(out.prompt, out.outputs[0].text, out.num_cached_tokens)
        print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)

Results are vLLM's shape (kvtier/outputs.py): one RequestOutput per prompt, its n samples in
`.outputs` (CompletionOutput: text, token_ids, finish_reason, ...), kvtier's reuse figures beside
them (prompt_tokens_reused, reused_by_tier, restore_method, ttft). `SamplingParams` defaults differ
from vLLM's in places (its docstring says which).

The keywords are the command line's options (`kvtier generate --help`, EngineOptions): the same
defaults, checks and store. `close()` (or leaving the `with` block) drains the saves and stops the
engine's threads; until then every prompt's state is saved, and a later prompt that shares a
prefix with it is restored instead of recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvtier.cli.engine_args import EngineOptions
from kvtier.engine.documents import mark
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models import DEFAULT_MODEL
from kvtier.outputs import RequestOutput, group
from kvtier.planning.blend import BlendOptions

Messages = Sequence[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **options: Any):
        """Load `model` (a preset, smollm2-135m, a directory, a Hub id or a .gguf file) and build its
        engine; `options` are EngineOptions fields (store="memory:1GB", no_store=True, dtype="fp32",
        max_num_seqs=8, ...). An unknown keyword is a TypeError naming it."""
        self.options = EngineOptions(model=model, **options)
        self.engine: Engine = self.options.build()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | None = None, *,
                 priority: Sequence[int] | None = None,
                 documents: Sequence[str | Sequence[int]] | Sequence[Sequence[str | Sequence[int]]] | None = None,
                 blend: bool | BlendOptions | None = None) -> list[RequestOutput]:
        """Complete a prompt (text or token ids) or a list of them, batched: one RequestOutput per
        prompt, in order, its SamplingParams(n=...) samples in `.outputs`. `priority` (vLLM's):
        one int per prompt; lower values are admitted first (a running request is not preempted
        for them), equal ones in prompt order. `documents`: the texts (or ids) in the prompt a
        blended restore may load from state computed alone (one list per prompt for a batch),
        with `blend` as `Engine.add_request` takes it (LLM(..., blend=True) allows blending)."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        # `single` tells a lone prompt from a batch; mypy cannot narrow the union on prompts[0].
        batch = cast("list[str | Sequence[int]]", [prompts] if single else list(prompts))
        per = cast("list[Sequence[str | Sequence[int]] | None]",
                   [None] * len(batch) if documents is None else [documents] if single else list(documents))
        if len(per) != len(batch):
            raise ValueError(f"documents has {len(per)} lists for {len(batch)} prompts")
        # Encoded here, once, so the outputs can carry prompt_token_ids; the engine takes ids as given
        # (a document's ids, located again in them).
        find = self.engine.finder(blend, None)  # documents precompiled here, where a prompt marks none
        marked = [mark(self.engine.encode, p, d, (), find) for p, d in zip(batch, per)]
        ids = [m[0] for m in marked]
        docs = [[i[a:b] for a, b in spans] for i, spans in marked]  # [] where none: not searched again
        return self._run([p if isinstance(p, str) else None for p in batch], ids, sampling_params, priority,
                         docs, blend)

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} messages) or a list of them, batched,
        through the model's chat template: a list of RequestOutput, one per conversation (as vLLM's
        LLM.chat, also for a single conversation), `.prompt` the rendered template."""
        batch = bool(messages) and not isinstance(messages[0], dict)
        conversations = cast("list[Messages]", list(messages) if batch else [messages])
        ids = [self.engine.encode_chat(c, tools=tools) for c in conversations]
        tok = self.engine.model.tokenizer
        assert tok is not None  # encode_chat raised PromptError for a model without a chat template
        texts: list[str | None] = [
            str(tok.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False, tools=tools))
            for c in conversations]
        return self._run(texts, ids, sampling_params)

    def precompile(self, documents: Sequence[str | Sequence[int]], cache_salt: str | None = None) -> tuple[int, int]:
        """Store each document's state computed alone, for blended requests -> (found stored, computed).
        Where the engine blends, later prompts of the same cache partition (`cache_salt`; `generate`'s
        is the default one) that mark no document are searched for these."""
        return self.engine.precompile(documents, cache_salt)

    def _run(self, prompts: list[str | None], ids: list[list[int]], sampling_params: SamplingParams | None,
             priority: Sequence[int] | None = None, documents: Sequence[Sequence[Sequence[int]] | None] | None = None,
             blend: bool | BlendOptions | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        outs = self.engine.generate(cast("list[str | Sequence[int]]", ids), params, priority,
                                    documents=documents, blend=blend)
        return group(outs, prompts, ids, params, self.engine.model.tokenizer, sorted(self.engine.eos_ids))

    def close(self) -> None:
        """Drain pending saves and stop the engine's threads (later calls do nothing)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
