"""Synthetic-but-real-text workloads for the trace benchmark.

Two shapes, both built from a seed so every configuration replays the same trace:

multiturn  chat sessions (ShareGPT-like). Sessions arrive as a Poisson process; each has a number
           of turns drawn around 5.75 (CachedAttention §4.2), user messages around 67 tokens and
           answers around 359 tokens per round (HCache §2.3); `output_scale` shrinks the answers
           when time is short. Between turns the user "thinks" (exponential think time). Every
           turn re-sends the whole conversation through the chat template, so its prefix is the
           previous turn's prompt plus the previous answer.
longdoc    several questions over the same long document (L-Eval-like, HCache §6.1.2). Each
           document is one "session" whose turns are independent questions: the prompt is the
           document plus the current question only, so the document is the shared prefix.

The text is real prose: the docstrings of Python standard-library modules and of their public
classes and functions (`inspect.getdoc`), which ship with the interpreter, so nothing is
downloaded. Token ids are never random.
"""

from __future__ import annotations

import importlib
import inspect
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any

# Per-round statistics quoted by the papers (ShareGPT4 via HCache §2.3; turns via CachedAttention §4.2).
MEAN_INPUT_TOKENS = 67.0
MEAN_OUTPUT_TOKENS = 359.0
MEAN_TURNS = 5.75
# L-Eval (HCache Table 1): instructions and outputs are short beside the context.
DOC_MEAN_QUESTION_TOKENS = 45.0
DOC_MEAN_OUTPUT_TOKENS = 50.0

SYSTEM_PROMPT = "You are a helpful assistant who explains Python library documentation clearly."

# Modules whose docstrings feed the text pool (all pure-stdlib, importable everywhere).
TEXT_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "gettext", "hashlib", "heapq", "hmac", "html", "http", "http.client", "http.cookies",
    "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging",
    "mailbox", "mimetypes", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "xml.etree.ElementTree",
    "zipfile", "zoneinfo",
)
# Modules with long docstrings and many documented members: one long document each.
DOC_MODULES = ("argparse", "json", "collections", "logging", "email", "asyncio", "http.client", "csv")


@dataclass(frozen=True)
class Passage:
    module: str
    name: str  # the documented object ("json", "json.dumps", ...)
    text: str


@dataclass(frozen=True)
class Turn:
    user: str  # the user's message of this turn
    max_tokens: int  # answer length budget (the model may stop earlier at EOS)
    think_s: float  # pause after the previous turn finished before this one is sent (0 for turn 0)


@dataclass(frozen=True)
class Session:
    session_id: str
    arrival_s: float  # offset of the first turn from the start of the trace
    turns: tuple[Turn, ...]
    system: str | None = None
    document: str | None = None  # longdoc: the shared context of every question
    accumulate: bool = True  # multiturn: every turn carries the whole conversation so far

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """The chat messages of `turn`, given the assistant's answers to the earlier turns."""
        msgs: list[dict[str, str]] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        if self.accumulate:
            for t, a in zip(self.turns[:turn], answers):
                msgs.append({"role": "user", "content": t.user})
                msgs.append({"role": "assistant", "content": a})
        user = self.turns[turn].user
        if self.document is not None:
            user = f"Read this documentation and answer the question.\n\n{self.document}\n\nQuestion: {user}"
        msgs.append({"role": "user", "content": user})
        return msgs


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any]

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


# ----- text -------------------------------------------------------------------------------------
def _clean(doc: str) -> str:
    return "\n".join(line.rstrip() for line in doc.strip().splitlines())


def stdlib_passages(modules: tuple[str, ...] = TEXT_MODULES, min_chars: int = 200) -> list[Passage]:
    """Docstrings of each module and of its public classes and functions, in a fixed order."""
    out: list[Passage] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optional module missing on this build
                continue
            doc = inspect.getdoc(mod)
            if doc and len(doc) >= min_chars:
                out.append(Passage(name, name, _clean(doc)))
            for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
                if attr.startswith("_"):
                    continue
                obj = getattr(mod, attr, None)
                if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                if getattr(obj, "__module__", "") != mod.__name__:
                    continue  # re-exported from elsewhere: counted where it is defined
                d = inspect.getdoc(obj)
                if d and len(d) >= min_chars:
                    out.append(Passage(name, f"{name}.{attr}", _clean(d)))
    return out


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the (unclipped) mean is `mean`
    return int(min(max(round(rng.lognormvariate(mu, sigma)), lo), hi))


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: fine for the small means used here.
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class _Cutter:
    """Cuts passages to a target token count (tokenizer-exact, ending on a whole token)."""

    def __init__(self, tokenizer: Any, passages: list[Passage], rng: random.Random):
        self.tok = tokenizer
        self.passages = list(passages)
        rng.shuffle(self.passages)
        self.i = 0

    def take(self, tokens: int) -> Passage:
        """The next passage cut to `tokens` tokens (continued by the following one if shorter)."""
        first = self.passages[self.i % len(self.passages)]
        texts: list[str] = []
        ids: list[int] = []
        while len(ids) < tokens:
            p = self.passages[self.i % len(self.passages)]
            self.i += 1
            texts.append(p.text)
            ids = self.tok.encode("\n\n".join(texts), add_special_tokens=False)
        text = "\n\n".join(texts)
        if len(ids) > tokens:
            text = self.tok.decode(ids[:tokens]).rstrip()
        return Passage(first.module, first.name, text)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


# ----- workloads --------------------------------------------------------------------------------
def multiturn(tokenizer: Any, sessions: int, rate: float, think_s: float, output_scale: float,
              seed: int = 0, max_turns: int = 12, mean_input: float = MEAN_INPUT_TOKENS,
              mean_output: float = MEAN_OUTPUT_TOKENS, mean_turns: float = MEAN_TURNS) -> Workload:
    """Chat sessions: Poisson arrivals at `rate` sessions/s, 1 + Poisson(mean_turns - 1) turns
    (capped), lognormal user/answer lengths around the paper means, exponential think times."""
    rng = random.Random(seed)
    cut = _Cutter(tokenizer, stdlib_passages(), rng)
    t = 0.0
    out = []
    for s in range(sessions):
        t += rng.expovariate(rate) if s else 0.0
        n = min(1 + _poisson(rng, mean_turns - 1), max_turns)
        turns = []
        for i in range(n):
            target = _lognormal(rng, mean_input, 0.8, 12, 512)
            lead = ("I am reading the Python documentation of `{m}`. Here is a passage:\n\n" if i == 0 else
                    "Thanks. Next, this passage from `{m}`:\n\n")
            tail = "\n\nWhat does it mean, in plain words?" if i == 0 else "\n\nHow does it relate to the previous one?"
            overhead = cut.count(lead.format(m="json") + tail)
            p = cut.take(max(target - overhead, 4))
            answer = max(2, round(_lognormal(rng, mean_output, 0.6, 16, 1536) * output_scale))
            think = rng.expovariate(1.0 / think_s) if i and think_s > 0 else 0.0
            turns.append(Turn(lead.format(m=p.module) + p.text + tail, answer, think))
        out.append(Session(f"chat-{s:03d}", t, tuple(turns), system=SYSTEM_PROMPT))
    params = dict(sessions=sessions, rate_per_s=rate, think_mean_s=think_s, output_scale=output_scale,
                  seed=seed, max_turns=max_turns, mean_input_tokens=mean_input,
                  mean_output_tokens=mean_output, mean_turns=mean_turns)
    return Workload("multiturn", tuple(out), params)


def long_document(tokenizer: Any, first: int, tokens: int) -> tuple[str, list[str]]:
    """A document of about `tokens` tokens: the docstrings of DOC_MODULES[first] and its members,
    continued with the next modules when one is too short, and the documented member names
    (the questions ask about those)."""
    parts: list[str] = []
    names: list[str] = []
    used = 0
    for j in range(len(DOC_MODULES)):
        module = DOC_MODULES[(first + j) % len(DOC_MODULES)]
        for p in stdlib_passages((module,), min_chars=80):
            if used >= tokens:
                break
            text = f"## {p.name}\n\n{p.text}"
            ids = tokenizer.encode(text, add_special_tokens=False)
            if used + len(ids) > tokens:
                text = tokenizer.decode(ids[: tokens - used]).rstrip()
            parts.append(text)
            if p.name != module:
                names.append(p.name)
            used += len(ids) + 2
        if used >= tokens:
            break
    return "\n\n".join(parts), names


def longdoc(tokenizer: Any, documents: int, questions: int, rate: float, think_s: float, doc_tokens: int,
            output_tokens: float = DOC_MEAN_OUTPUT_TOKENS, seed: int = 0) -> Workload:
    """`documents` readers, each asking `questions` questions (think time apart) about one long
    document; readers arrive as a Poisson process at `rate` per second."""
    rng = random.Random(seed + 1)
    templates = ("What is `{n}` used for, according to the document?",
                 "Summarize what the document says about `{n}`.",
                 "Which arguments does `{n}` take, and what do they control?",
                 "When should I prefer `{n}` over the alternatives described in the document?",
                 "Give a short example of using `{n}`, based on the document.")
    t = 0.0
    out = []
    for d in range(documents):
        t += rng.expovariate(rate) if d else 0.0
        module = DOC_MODULES[d % len(DOC_MODULES)]
        doc, names = long_document(tokenizer, d % len(DOC_MODULES), doc_tokens)
        names = names[: max(len(names) // 2, 1)] or [module]  # ask about the first half: the start of the text
        turns = []
        for q in range(questions):
            name = names[rng.randrange(len(names))]
            text = templates[q % len(templates)].format(n=name)
            answer = max(2, _lognormal(rng, output_tokens, 0.5, 8, 400))
            think = rng.expovariate(1.0 / think_s) if q and think_s > 0 else 0.0
            turns.append(Turn(text, answer, think))
        out.append(Session(f"doc-{d:02d}-{module}", t, tuple(turns), system=SYSTEM_PROMPT, document=doc,
                           accumulate=False))
    params = dict(documents=documents, questions=questions, rate_per_s=rate, think_mean_s=think_s,
                  doc_tokens=doc_tokens, mean_output_tokens=output_tokens, seed=seed)
    return Workload("longdoc", tuple(out), params)
