"""Offline accuracy tasks whose answer depends on a few tokens of a long shared prefix.

Needle multiple choice: "The secret word is W." sits at a given depth of a document made of
Python standard-library docstrings (text every machine has); the shared prefix is the chat up to
the end of the document, the query asks for the word, and the answer is scored lm-eval style: the
highest log-likelihood among W and three distractors that do not occur in the text. Chance is 25%.
Seeded: the same arguments give the same items on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvtier.text import stdlib_docstrings

# Concrete, single-word answers (spelled as they would follow "The secret word is").
WORDS = (
    "apricot", "lantern", "glacier", "violin", "pelican", "saffron", "harbor", "meteor", "walnut", "canyon",
    "trumpet", "orchid", "falcon", "marble", "cactus", "dolphin", "emerald", "thimble", "volcano", "penguin",
    "cinnamon", "compass", "lobster", "tornado", "velvet", "pumpkin", "anchor", "giraffe", "mango", "quartz",
    "raccoon", "sapphire", "tulip", "waffle", "zebra", "biscuit", "coconut", "dragonfly", "jasmine", "kangaroo",
    "lemonade", "mushroom", "nutmeg", "octopus", "pineapple", "rhubarb", "squirrel", "turquoise", "umbrella",
    "walrus",
)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
QUESTION = "What is the secret word mentioned in the text above? Answer with the word only."
ANSWER_PREFIX = "The secret word is"


@dataclass(frozen=True)
class NeedleItem:
    prefix_ids: list[int]  # the chat up to the end of the document: the shared, stored prefix
    query_ids: list[int]  # the question, the assistant turn's start and the answer prefix
    choices: list[list[int]]  # token ids of each candidate answer (as it continues the query)
    answer: int  # index of the right one in `choices`
    depth: float
    doc_tokens: int


def _document(tok: Any, tokens: int, depth: float, word: str, rng: random.Random) -> str:
    """About `tokens` tokens of docstrings with the needle sentence at `depth` (between sentences)."""
    docs = stdlib_docstrings()
    start = rng.randrange(len(docs))
    parts, have = [], 0
    for d in docs[start:] + docs[:start]:
        parts.append(d)
        have += len(tok.encode(d, add_special_tokens=False))
        if have >= tokens:
            break
    ids = tok.encode("\n\n".join(parts), add_special_tokens=False)[:tokens]
    text = tok.decode(ids)
    cut = int(depth * len(text))
    stop = text.find(". ", cut)
    cut = stop + 2 if 0 <= stop < cut + 400 else cut
    return text[:cut] + f"The secret word is {word}. " + text[cut:]


def needle_items(tok: Any, n: int, lengths: tuple[int, ...] = (1024, 2048, 4096), seed: int = 0) -> list[NeedleItem]:
    """`n` items cycling over depths and document lengths (about `length` tokens of text each)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        depth, length = DEPTHS[i % len(DEPTHS)], lengths[(i // len(DEPTHS)) % len(lengths)]
        word, *others = rng.sample(WORDS, 12)
        doc = _document(tok, length, depth, word, rng)
        distractors = [w for w in others if w not in doc.lower()][:3]
        if len(distractors) < 3:
            raise RuntimeError("not enough distractors absent from the document; widen WORDS")
        system = [{"role": "user", "content": doc + "\n\n" + QUESTION}]
        chat = tok.apply_chat_template(system, tokenize=False, add_generation_prompt=True) + ANSWER_PREFIX
        split = chat.index(doc) + len(doc)  # the shared prefix ends with the document
        prefix_ids = tok.encode(chat[:split], add_special_tokens=False)
        query_ids = tok.encode(chat[split:], add_special_tokens=False)
        options = [word] + distractors
        order = list(range(4))
        rng.shuffle(order)
        choices = [tok.encode(" " + options[j], add_special_tokens=False) for j in order]
        items.append(NeedleItem(prefix_ids, query_ids, choices, order.index(0), depth, len(prefix_ids)))
    return items
