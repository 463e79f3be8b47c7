"""Prompts in: text, chat messages or token ids to the token list a request runs on (the
tokenizer, the chat template, the context window and, where configured, context truncation).
Runs on the caller's thread, before anything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.models.loading import LoadedModel
from kvtier.planning.truncation import TruncationConfig, kept_positions


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, too long, bad token ids, no tokenizer)."""


def check_text(value: Any, where: str) -> None:
    """Every string in `value` (nested in lists and dicts, keys too) is well-formed Unicode: a lone
    surrogate, which a JSON escape like \\ud800 can carry, has no UTF-8 form and the tokenizer
    refuses it with a TypeError. Raises PromptError naming `where`."""
    stack = [value]
    while stack:  # a loop, not recursion: nesting depth is the sender's to choose
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PromptError(f"{where} hold a lone surrogate (U+{ord(v[e.start]):04X}), which is not valid "
                                  "Unicode; send well-formed text") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def encode(model: LoadedModel, prompt: str | Sequence[int], add_special_tokens: bool = False) -> list[int]:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise PromptError(f"model {model.name} has no tokenizer; pass token ids")
        check_text(prompt, "the prompt's texts")
        return list(model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return [int(t) for t in prompt]


def encode_chat(model: LoadedModel, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    tok = model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise PromptError(f"model {model.name} has no chat template")
    if not messages:
        raise PromptError("messages must not be empty")
    check_text([messages, tools], "the messages and tools")
    ids = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                  tools=tools)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token's text can have: the longest string of the vocabulary (a
    byte-level vocabulary's strings have a character per byte, more than the text's characters);
    None without a vocabulary."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    return max((len(w) for w in vocab()), default=None)


def validate(ids: Sequence[int], max_model_len: int, vocab: int) -> None:
    if not ids:
        raise PromptError("the prompt is empty")
    if len(ids) > max_model_len:  # a prompt that fills the window still yields one token
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the context window is {max_model_len}; "
            "shorten the prompt"
        )
    if min(ids) < 0 or max(ids) >= vocab:
        raise PromptError(f"token ids must be in [0, {vocab})")


def truncate(ids: list[int], max_tokens: int, max_model_len: int, truncation: TruncationConfig | None,
             ) -> tuple[list[int], list[int] | None, list[int] | None]:
    """A prompt that fills the window, cut down by `truncation` (None: left as it is, and refused
    by `validate`) -> (the ids kept, the original ids, the kept indices); the last two are None
    when nothing was cut."""
    if truncation is None or len(ids) < max_model_len:
        return ids, None, None
    # Leave room to generate: at most max_tokens, at most half the window.
    limit = max_model_len - min(max_tokens, max_model_len // 2)
    kept = kept_positions(len(ids), limit, truncation)
    return [ids[i] for i in kept], ids, kept
