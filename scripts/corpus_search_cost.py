"""The cost of finding known documents in unmarked prompts (engine/corpus.py; pure Python, one thread):
ordinary prompts, and prompts built to follow the index everywhere (docs/blend.md).

    .venv/bin/python scripts/corpus_search_cost.py
"""

from __future__ import annotations

import random
import string
import time

from kvtier.engine.corpus import Corpus

rnd = random.Random(0)


def words(n: int) -> str:
    return "".join(rnd.choice(string.ascii_lowercase + "     ") for _ in range(n))


def seconds(corpus: Corpus, prompt: str | list[int]) -> float:
    t = time.perf_counter()
    corpus.finder()(prompt)
    return time.perf_counter() - t


def corpus_of(texts: list[str]) -> Corpus:
    c = Corpus()
    c.add((t, list(range(8))) for t in texts)  # ids stand-ins: only the texts are searched here
    return c


def main() -> None:
    rows = []
    c = corpus_of([words(2000) for _ in range(3000)])
    rows.append(("3,000 random documents of 2K characters; a random prompt of 200K", seconds(c, words(200_000))))
    doc = words(2000)
    c.add([(doc, list(range(8)))])
    rows.append(("the same; a 30K prompt holding one of them", seconds(c, words(14_000) + doc + words(14_000))))
    c = corpus_of(["=" * 40 + words(60_000) for _ in range(3000)])
    rows.append(("3,000 documents of 60K opening with '=' x 40; a prompt of '=' x 200K", seconds(c, "=" * 200_000)))
    header = '<!DOCTYPE html>\n<html lang="en">'
    c = corpus_of([header + words(5000) for _ in range(3000)])
    rows.append(("3,000 pages sharing a header; a prompt of the header x 6,250", seconds(c, header * 6250)))
    ids = Corpus()
    ids.add((None, [5] * 8 + [rnd.randrange(1000, 30000) for _ in range(60_000)]) for _ in range(300))
    rows.append(("300 documents of 60K ids opening with 8 equal ids; a prompt of 50K of that id", seconds(ids, [5] * 50_000)))
    rows.append(("the same; a random prompt of 50K ids", seconds(ids, [rnd.randrange(30000) for _ in range(50_000)])))
    print("| corpus; prompt | seconds |\n|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.3f} |")


if __name__ == "__main__":
    main()
