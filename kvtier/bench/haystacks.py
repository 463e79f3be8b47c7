"""Retrieval over haystacks of several kinds: does an importance restore keep a fact wherever, in
whatever text and form, it sits?

`bench/tasks.py`'s free-form retrieval plants facts in standard-library docstrings only, the text
the probe heads are calibrated on. Here the haystack is one of:

docstrings  standard-library docstrings (that benchmark's text)
reference   the Python language reference (pydoc's topics: hard-wrapped technical prose, grammar)
code        standard-library source; a fact is a comment line
table       a markdown table of seeded records; a fact is a note line between rows
dialogue    a meeting transcript (speakers, short replies, reference sentences); a fact is a turn
wiki        lower-cased Wikipedia passages (MuSiQue's, read from ../shared/data/musique when present)

and a fact is one of four forms: a five-digit access code, a keeper's name, a date, or a
three-word password phrase. One to four facts of the same form sit at uniform random depths; one
is asked. Each item records its slice labels (haystack, form, length, facts, depth of the asked
fact) and the asked value's token span in the prefix, for the diagnosis of which layers keep it.
Seeded: the same arguments give the same items on every machine.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.tasks import FIRST_NAMES, LAST_NAMES, WORDS, filler

LENGTHS = (1024, 2048, 3072, 4096)
FACT_COUNTS = (1, 2, 3, 4)
DEPTH_BINS = 5  # the asked fact's depth, reported in fifths of the document


# ----- haystacks ---------------------------------------------------------------------------------
def _cut(tok: Any, text: str, tokens: int) -> str:
    return tok.decode(tok.encode(text, add_special_tokens=False)[:tokens])


def _reference(tok: Any, tokens: int, rng: random.Random) -> str:
    """Language-reference topics from a random one on, about `tokens` tokens."""
    import pydoc_data.topics

    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    start = rng.randrange(len(topics))
    return _cut(tok, "\n\n".join(topics[start:] + topics[:start])[: tokens * 8], tokens)


CODE_MODULES = ("textwrap", "shlex", "csv", "heapq", "bisect", "statistics", "calendar", "difflib", "fractions",
                "string", "json.decoder", "json.encoder", "colorsys", "glob", "fnmatch", "queue", "sched", "tokenize")


def _code(tok: Any, tokens: int, rng: random.Random) -> str:
    """Standard-library source from a random module on."""
    start = rng.randrange(len(CODE_MODULES))
    order = CODE_MODULES[start:] + CODE_MODULES[:start]
    return _cut(tok, "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in order[:4]), tokens)


COLOURS = ("red", "blue", "green", "ochre", "teal", "maroon", "ivory", "slate", "amber", "violet")
CITIES = ("Lisbon", "Osaka", "Tallinn", "Quito", "Lagos", "Perth", "Bergen", "Cusco", "Hanoi", "Tunis", "Denver",
          "Porto", "Krakow", "Medan", "Leeds", "Cairo")


def _table(tok: Any, tokens: int, rng: random.Random) -> str:
    """A markdown inventory table of seeded records (about 25 tokens a row)."""
    head = "| id | item | colour | owner | city | qty | price |\n|---|---|---|---|---|---|---|\n"
    rows, text = 0, head
    while len(text) < tokens * 4:
        rows += 1
        text += (f"| {rng.randrange(100000, 999999)} | {rng.choice(WORDS)} | {rng.choice(COLOURS)} | "
                 f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)} | {rng.choice(CITIES)} | {rng.randrange(1, 500)} | "
                 f"{rng.randrange(1, 10000) / 100:.2f} |\n")
    return _cut(tok, text, tokens)


REPLIES = ("Okay.", "Right, go on.", "Wait, can you say that again?", "Makes sense to me.", "Hm, not sure about that.",
           "Agreed.", "Let's move on.", "Good point.", "Who owns that?", "I'll write it down.")


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 20 < len(s.strip()) < 300]


def _dialogue(tok: Any, tokens: int, rng: random.Random) -> str:
    """A meeting transcript: three speakers taking turns, reference sentences and short replies."""
    speakers = rng.sample(FIRST_NAMES, 3)
    lines = _sentences(_reference(tok, tokens * 2, rng))
    out: list[str] = []
    text = ""
    while len(text) < tokens * 5 and lines:
        who = speakers[len(out) % 3]
        say = rng.choice(REPLIES) if rng.random() < 0.3 else " ".join(lines.pop(0) for _ in range(min(2, len(lines))))
        out.append(f"{who}: {say}")
        text = "\n".join(out)
    return _cut(tok, text, tokens)


def _wiki(data: Path) -> Callable[[Any, int, random.Random], str]:
    from kvtier.bench.blend.data import load_questions  # here: it pulls in torch, which the other kinds need not

    passages = [p for q in load_questions(data, 0, 10**6) for p in q.passages]

    def text(tok: Any, tokens: int, rng: random.Random) -> str:
        start = rng.randrange(len(passages))
        return _cut(tok, "\n\n".join(passages[start:] + passages[:start])[: tokens * 8], tokens)
    return text


def _insert_line(text: str, line: str, depth: float) -> str:
    """`line` put into `text` as a line of its own at about `depth` of its length."""
    cut = int(depth * len(text))
    stop = text.find("\n", cut)
    cut = stop + 1 if 0 <= stop < cut + 400 else cut
    return text[:cut] + line + "\n" + text[cut:]


@dataclass(frozen=True)
class Haystack:
    name: str
    text: Callable[[Any, int, random.Random], str]  # (tokenizer, tokens, rng) -> about that many tokens
    insert: Callable[[str, str, random.Random, float], str]  # (text, fact sentence, rng, depth) -> text with it


def _as_sentence(text: str, fact: str, rng: random.Random, depth: float) -> str:
    """After the next sentence's end near `depth`, else between words (never inside one)."""
    cut = int(depth * len(text))
    stop = text.find(". ", cut)
    if not 0 <= stop < cut + 400:
        stop = text.find(" ", cut)
        return text + " " + fact if stop < 0 else text[: stop + 1] + fact + " " + text[stop + 1 :]
    return text[: stop + 2] + fact + " " + text[stop + 2 :]


def _as_comment(text: str, fact: str, rng: random.Random, depth: float) -> str:
    return _insert_line(text, f"# {fact}", depth)


def _as_note(text: str, fact: str, rng: random.Random, depth: float) -> str:
    return _insert_line(text, f"Note: {fact}", depth)


def _as_turn(text: str, fact: str, rng: random.Random, depth: float) -> str:
    return _insert_line(text, f"{rng.choice(FIRST_NAMES)}: {fact}", depth)


def haystacks(wiki_data: Path | None = None) -> dict[str, Haystack]:
    """Every haystack kind; wiki only when its data file is given and exists."""
    out = {"docstrings": Haystack("docstrings", filler, _as_sentence),
           "reference": Haystack("reference", _reference, _as_sentence),
           "code": Haystack("code", _code, _as_comment),
           "table": Haystack("table", _table, _as_note),
           "dialogue": Haystack("dialogue", _dialogue, _as_turn)}
    if wiki_data is not None and wiki_data.is_file():
        out["wiki"] = Haystack("wiki", _wiki(wiki_data), _as_sentence)
    return out


# ----- facts -------------------------------------------------------------------------------------
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
PHRASE_WORDS = ("amber", "copper", "quiet", "northern", "hollow", "silver", "crimson", "gentle", "broken", "distant",
                "river", "lantern", "meadow", "thunder", "pebble", "feather", "harvest", "cellar", "willow", "beacon")


@dataclass(frozen=True)
class FactForm:
    statement: str  # the sentence put into the haystack ({key}, {value})
    question: str
    answer_prefix: str  # the assistant turn starts with it: the value comes next
    value: Callable[[random.Random], str]


FORMS = {
    "code": FactForm("The access code for the {key} vault is {value}.", "What is the access code for the {key} vault?",
                     "The access code for the {key} vault is", lambda r: str(r.randrange(10000, 100000))),
    "name": FactForm("The keeper of the {key} vault is {value}.", "Who is the keeper of the {key} vault?",
                     "The keeper of the {key} vault is",
                     lambda r: f"{r.choice(FIRST_NAMES)} {r.choice(LAST_NAMES)}"),
    "date": FactForm("The {key} vault was last opened on {value}.", "On what date was the {key} vault last opened?",
                     "The {key} vault was last opened on",
                     lambda r: f"{r.randrange(1, 29)} {r.choice(MONTHS)} {r.randrange(1950, 2025)}"),
    "phrase": FactForm("The password for the {key} vault is {value}.", "What is the password for the {key} vault?",
                       "The password for the {key} vault is", lambda r: " ".join(r.sample(PHRASE_WORDS, 3))),
}


# ----- items -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HaystackItem:
    prefix_ids: list[int]  # the chat up to the end of the document: the stored prefix
    query_ids: list[int]  # the question, the assistant turn's start and the answer prefix
    answer: str
    answer_span: tuple[int, int]  # the asked value's tokens in prefix_ids [start, stop)
    haystack: str
    form: str
    facts: int
    length: int  # tokens of haystack text asked for
    depth: float  # the asked fact's depth in the haystack, 0..1

    @property
    def slices(self) -> tuple[str, ...]:
        """The labels it is reported under."""
        b = min(int(self.depth * DEPTH_BINS), DEPTH_BINS - 1)
        return (f"haystack={self.haystack}", f"form={self.form}", f"length={self.length}", f"facts={self.facts}",
                f"depth={b / DEPTH_BINS:.1f}-{(b + 1) / DEPTH_BINS:.1f}")

    def correct(self, text: str) -> bool:
        """The value appears in the answer whole (not inside a longer number or word; commas and
        case ignored)."""
        return re.search(rf"(?<![0-9A-Za-z]){re.escape(self.answer.lower())}(?![0-9A-Za-z])",
                         text.replace(",", "").lower()) is not None


def _span(tok: Any, text: str, start: int, stop: int) -> tuple[int, int]:
    """Token indices [a, b) of `tok.encode(text)` covering characters [start, stop)."""
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    a = next(i for i, (s, e) in enumerate(offsets) if e > start)
    b = next((i for i, (s, e) in enumerate(offsets) if s >= stop), len(offsets))
    return a, b


def _balanced(rng: random.Random, values: Sequence, n: int) -> list:
    """`n` values, each equally often (as near as n allows), in a seeded order."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def haystack_items(tok: Any, n: int, kinds: dict[str, Haystack], forms: Sequence[str] = tuple(FORMS),
                   lengths: Sequence[int] = LENGTHS, counts: Sequence[int] = FACT_COUNTS,
                   seed: int = 0) -> list[HaystackItem]:
    """`n` items cycling over (haystack, form); lengths and fact counts balanced within each block
    of len(kinds) x len(forms) items."""
    if unknown := set(forms) - set(FORMS):
        raise ValueError(f"unknown fact forms {sorted(unknown)} (choose from {', '.join(FORMS)})")
    rng = random.Random(seed)
    combos = [(h, f) for f in forms for h in kinds]
    block = len(combos)
    items: list[HaystackItem] = []
    for start in range(0, n, block):
        lens, cnts = _balanced(rng, lengths, block), _balanced(rng, counts, block)
        for j, (h, f) in enumerate(combos[: n - start]):
            items.append(_item(tok, kinds[h], f, lens[j], cnts[j], rng))
    return items


def _item(tok: Any, kind: Haystack, form_name: str, length: int, count: int, rng: random.Random) -> HaystackItem:
    form = FORMS[form_name]
    keys = rng.sample(WORDS, count)
    values: list[str] = []
    while len(values) < count:  # distinct values: another fact must not answer the question
        if (v := form.value(rng)) not in values:
            values.append(v)
    depths = [rng.uniform(0.02, 0.98) for _ in keys]
    doc = kind.text(tok, length, rng)
    for depth, key, value in sorted(zip(depths, keys, values), reverse=True):  # deepest first: depths hold
        doc = kind.insert(doc, form.statement.format(key=key, value=value), rng, depth)
    asked = rng.randrange(count)
    key, value = keys[asked], values[asked]
    chat = tok.apply_chat_template([{"role": "user", "content": doc + "\n\n" + form.question.format(key=key)}],
                                   tokenize=False, add_generation_prompt=True) + form.answer_prefix.format(key=key)
    split = chat.index(doc) + len(doc)
    statement = form.statement.format(key=key, value=value)
    at = chat.index(statement) + statement.index(value)
    prefix_ids = tok.encode(chat[:split], add_special_tokens=False)
    return HaystackItem(prefix_ids, tok.encode(chat[split:], add_special_tokens=False), value,
                        _span(tok, chat[:split], at, at + len(value)), kind.name, form_name, count, length,
                        depths[asked])
