"""`kvtier.LLM`: the short way in from Python, in the shape of vLLM's offline `LLM`.

    from kvtier import LLM, SamplingParams

    with LLM("smollm2-135m", store="memory:1GB") as llm:
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].text)
        print(llm.chat([{"role": "user", "content": "Hi!"}]).text)

The keywords are the command line's options (`kvtier generate --help`, EngineOptions): the same
defaults, checks and store. `close()` (or leaving the `with` block) drains the saves and stops the
engine's threads; until then every prompt's state is saved, and a later prompt that shares a
prefix with it is restored instead of recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvtier.cli.engine_args import EngineOptions
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models import DEFAULT_MODEL

Messages = Sequence[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **options: Any):
        """Load `model` (a preset, smollm2-135m, a directory, a Hub id or a .gguf file) and build its
        engine; `options` are EngineOptions fields (store="memory:1GB", no_store=True, dtype="fp32",
        max_num_seqs=8, ...). An unknown keyword is a TypeError naming it."""
        self.options = EngineOptions(model=model, **options)
        self.engine: Engine = self.options.build()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete a prompt (text or token ids) or a list of them, batched; one output per prompt
        (n per prompt with SamplingParams(n=...)), in order."""
        return self.engine.generate(prompts, sampling_params)

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None) -> Any:
        """Answer a conversation (a list of {"role", "content"} messages) through the model's chat
        template: one RequestOutput; given a list of conversations, a list of them, batched."""
        batch = bool(messages) and not isinstance(messages[0], dict)
        conversations = cast("list[Messages]", list(messages) if batch else [messages])
        outs = self.engine.generate([self.engine.encode_chat(c, tools=tools) for c in conversations], sampling_params)
        return outs if batch else outs[0]

    def close(self) -> None:
        """Drain pending saves and stop the engine's threads (later calls do nothing)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
