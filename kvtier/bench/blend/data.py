"""The blend benchmark's prompts: MuSiQue questions with their ten passages in a shuffled order
(the chat template around them), or random token ids shaped the same way for random-weight models.

Every method is run on one and the same token list per question: the passages are marked once
(documents.mark tokenizes each passage alone) and the full prefill runs on those ids too, so a
difference between rows is the method's, never the tokenizer's.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.documents import mark

DEFAULT_DATA = "../shared/data/musique/musique_dev_100.json"
DATA_ENV = "KVTIER_MUSIQUE"
ATTRIBUTION = ("MuSiQue (Trivedi, Balasubramanian, Khot, Sabharwal, \"MuSiQue: Multihop Questions via Single-hop "
               "Question Composition\", TACL 2022), CC BY 4.0; the first 100 of the 150 development questions "
               "the CacheBlend paper (Yao et al., EuroSys 2025) used")
INSTRUCTION = "Answer the question using the passages below."
PASSAGES = 10


@dataclass(frozen=True)
class Question:
    """One record: the question, its gold answers and its passages in the data's order."""

    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]


@dataclass(frozen=True)
class Prompt:
    """A question as every row runs it: `ids` with the passages' `spans`, the passages as the
    prompt holds them (what is precompiled), and `warm_ids`, the same prompt with the passages in
    another order (the earlier request exact prefix reuse is given)."""

    index: int  # the record's index in the data (or the synthetic question's number)
    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    documents: tuple[str | tuple[int, ...], ...]
    warm_ids: tuple[int, ...]
    answers: tuple[str, ...]  # gold answers (none for random ids)
    question: str = ""


def data_path(given: str | None) -> Path:
    """--data, else $KVTIER_MUSIQUE, else the shared copy beside the repository."""
    return Path(given or os.environ.get(DATA_ENV) or DEFAULT_DATA)


def load_questions(path: Path, offset: int, n: int) -> list[Question]:
    """Records [offset, offset + n) of the MuSiQue file; a passage is "title\\ntext", or the text
    where the title is empty."""
    records = json.loads(path.read_text())[offset : offset + n]
    out = []
    for r in records:
        passages = tuple(f"{c['title'].strip()}\n{c['text'].strip()}" if c.get("title", "").strip()
                         else c["text"].strip() for c in r["ctxs"])
        out.append(Question(r["question"].strip(), tuple(r["answers"]), passages))
    return out


def orders(seed: int, index: int, n: int) -> tuple[list[int], list[int]]:
    """The question's passage order and a second one for the warm request, seeded per question;
    the second starts with another passage, so the two prompts share no passage in their prefix."""
    rng = random.Random(f"blend-bench:{seed}:{index}")
    order = list(range(n))
    rng.shuffle(order)
    warm = order[:]
    while n > 1 and warm[0] == order[0]:
        rng.shuffle(warm)
    return order, warm


def render(tokenizer: Any, passages: Sequence[str], question: str) -> str:
    """One user message (instruction, passages apart by blank lines, the question) in the model's
    chat template with the assistant's turn opened; plain text where the tokenizer has none."""
    content = "\n\n".join([INSTRUCTION, *passages, f"Question: {question}\nAnswer briefly."])
    if not getattr(tokenizer, "chat_template", None):
        return content
    return str(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False))


def text_prompt(encode: Callable[[Any], list[int]], tokenizer: Any, q: Question, index: int, seed: int) -> Prompt:
    """A MuSiQue question as token ids with its passages marked, and the warm order's ids."""
    order, warm = orders(seed, index, len(q.passages))
    passages = [q.passages[i] for i in order]
    ids, spans = mark(encode, render(tokenizer, passages, q.question), passages, ())
    warm_passages = [q.passages[i] for i in warm]
    warm_ids, _ = mark(encode, render(tokenizer, warm_passages, q.question), warm_passages, ())
    return Prompt(index, tuple(ids), tuple(spans), tuple(passages), tuple(warm_ids), q.answers, q.question)


def synthetic_prompt(vocab: int, index: int, seed: int, passage_tokens: int) -> Prompt:
    """Random ids laid out as a real prompt: a header, ten passages apart by two-token separators,
    a question; no gold answers. Ids start at 3, past the special ones."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    header, sep, tail = draw(16), draw(2), draw(12)
    passages = [tuple(draw(passage_tokens)) for _ in range(PASSAGES)]
    order, warm = orders(seed, index, PASSAGES)

    def laid_out(seq: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        ids, spans = list(header), []
        for j, i in enumerate(seq):
            if j:
                ids += sep
            spans.append((len(ids), len(ids) + passage_tokens))
            ids += passages[i]
        return ids + tail, spans

    ids, spans = laid_out(order)
    warm_ids, _ = laid_out(warm)
    return Prompt(index, tuple(ids), tuple(spans), tuple(passages[i] for i in order), tuple(warm_ids), ())
