"""Offline accuracy tasks whose answer depends on a few tokens of a long shared prefix.

Documents are Python standard-library docstrings (text every machine has); the shared prefix is
the chat up to the end of the document and the query follows it. Seeded: the same arguments give
the same items on every machine.

Needle multiple choice: "The secret word is W." sits at a given depth; the query asks for the
word, and the answer is scored lm-eval style: the highest log-likelihood among W and three
distractors that do not occur in the text. Chance is 25%.

Free-form retrieval: one or four facts ("The access code for the walnut vault is 19494.", a
number of coins, a keeper's name) at random depths; the query asks for one of them and the
answer is decoded greedily and right when it contains the fact exactly (chance: nil). Each item
also carries a summary request, whose reference answer (decoded with the full prefix) is scored
teacher-forced under a restore: a perplexity proxy for tasks that need the whole document.
"""

from __future__ import annotations

import random
import re
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
    length: int  # the document's length asked for


def filler(tok: Any, tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of docstrings from a random starting docstring."""
    docs = stdlib_docstrings()
    start = rng.randrange(len(docs))
    parts, have = [], 0
    for d in docs[start:] + docs[:start]:
        parts.append(d)
        have += len(tok.encode(d, add_special_tokens=False))
        if have >= tokens:
            break
    ids = tok.encode("\n\n".join(parts), add_special_tokens=False)[:tokens]
    return tok.decode(ids)


def _insert(text: str, sentence: str, depth: float) -> str:
    """`sentence` put into `text` at about `depth` of its length, after the next sentence's end."""
    cut = int(depth * len(text))
    stop = text.find(". ", cut)
    cut = stop + 2 if 0 <= stop < cut + 400 else cut
    return text[:cut] + sentence + " " + text[cut:]


def _document(tok: Any, tokens: int, depth: float, word: str, rng: random.Random) -> str:
    """About `tokens` tokens of docstrings with the needle sentence at `depth` (between sentences)."""
    return _insert(filler(tok, tokens, rng), f"The secret word is {word}.", depth)


def _split_chat(tok: Any, doc: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
    """The user turn (document, question) and the assistant's answer prefix, cut after the
    document: (shared prefix ids, query ids)."""
    chat = tok.apply_chat_template([{"role": "user", "content": doc + "\n\n" + question}], tokenize=False,
                                   add_generation_prompt=True) + answer_prefix
    split = chat.index(doc) + len(doc)
    return tok.encode(chat[:split], add_special_tokens=False), tok.encode(chat[split:], add_special_tokens=False)


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
        prefix_ids, query_ids = _split_chat(tok, doc, QUESTION, ANSWER_PREFIX)
        options = [word] + distractors
        order = list(range(4))
        rng.shuffle(order)
        choices = [tok.encode(" " + options[j], add_special_tokens=False) for j in order]
        items.append(NeedleItem(prefix_ids, query_ids, choices, order.index(0), depth, len(prefix_ids), length))
    return items


# ----- free-form retrieval ----------------------------------------------------------------------
FIRST_NAMES = ("Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jonas",
               "Keiko", "Lucas", "Marta", "Nikolai", "Olga", "Pavel", "Rosa", "Stefan", "Tamsin", "Viktor")
LAST_NAMES = ("Abernathy", "Brennan", "Castellano", "Delacroix", "Eriksen", "Fairbanks", "Goldberg", "Halvorsen",
              "Ibarra", "Jablonski", "Kowalczyk", "Lindqvist", "Montague", "Nakamura", "Okonkwo", "Pemberton",
              "Quintero", "Rasmussen", "Szabo", "Thornbury")


@dataclass(frozen=True)
class FactKind:
    statement: str  # the sentence put into the document ({key}, {value})
    question: str
    answer_prefix: str  # the assistant turn starts with it: the value comes next


FACT_KINDS = {
    "code": FactKind("The access code for the {key} vault is {value}.", "What is the access code for the {key} vault?",
                     "The access code for the {key} vault is"),
    "number": FactKind("The {key} vault holds {value} gold coins.", "How many gold coins does the {key} vault hold?",
                       "The {key} vault holds"),
    "name": FactKind("The keeper of the {key} vault is {value}.", "Who is the keeper of the {key} vault?",
                     "The keeper of the {key} vault is"),
}
SUMMARY = "Summarize the text above in two sentences."


def fact_value(kind: str, rng: random.Random) -> str:
    """A value of a fact kind: five digits, a number of coins, or a first and last name."""
    if kind == "code":
        return str(rng.randrange(10000, 100000))
    if kind == "number":
        return str(rng.randrange(1000, 10000))
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


@dataclass(frozen=True)
class RetrievalItem:
    prefix_ids: list[int]  # the chat up to the end of the document
    query_ids: list[int]  # the question, the assistant turn's start and the answer prefix
    summary_ids: list[int]  # the summary request after the same document, and the assistant turn's start
    answer: str  # the fact's value, which the decoded answer must contain
    kind: str
    facts: int
    length: int  # the document's length asked for (tokens of text; doc_tokens adds the chat's and the facts')
    doc_tokens: int

    def correct(self, text: str) -> bool:
        """Exact match: the value appears in the answer as a whole (not inside a longer number or
        name; digit groups' commas ignored)."""
        return re.search(rf"(?<![0-9A-Za-z]){re.escape(self.answer)}(?![0-9A-Za-z])", text.replace(",", "")) is not None


def retrieval_items(tok: Any, n: int, lengths: tuple[int, ...] = (1024, 2048, 4096), facts: tuple[int, ...] = (1, 4),
                    seed: int = 0) -> list[RetrievalItem]:
    """`n` items cycling over (document length, facts) and the fact kinds; each asks for one of its
    facts, all of one kind about different vaults, at random depths."""
    rng = random.Random(seed)
    cells = [(length, f) for length in lengths for f in facts]
    items = []
    for i in range(n):
        length, count = cells[i % len(cells)]
        kind_name = tuple(FACT_KINDS)[(i // len(cells)) % len(FACT_KINDS)]
        kind = FACT_KINDS[kind_name]
        keys = rng.sample(WORDS, count)
        values: list[str] = []
        while len(values) < count:  # distinct values: the other facts must not answer the question
            v = fact_value(kind_name, rng)
            if v not in values:
                values.append(v)
        doc = filler(tok, length, rng)
        for depth, key, value in sorted(zip((rng.uniform(0.05, 0.95) for _ in keys), keys, values), reverse=True):
            doc = _insert(doc, kind.statement.format(key=key, value=value), depth)  # deepest first: depths hold
        asked = rng.randrange(count)
        key = keys[asked]
        prefix_ids, query_ids = _split_chat(tok, doc, kind.question.format(key=key), kind.answer_prefix.format(key=key))
        summary_prefix, summary_ids = _split_chat(tok, doc, SUMMARY, "")
        assert summary_prefix == prefix_ids  # both questions follow the same stored document
        items.append(RetrievalItem(prefix_ids, query_ids, summary_ids, values[asked], kind_name, count, length,
                                     len(prefix_ids)))
    return items
