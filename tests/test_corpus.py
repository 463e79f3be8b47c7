"""Documents found in prompts that mark none (engine/corpus.py): in order, the longest at a
position, per cache partition, documents that share long openings, at a bounded cost on a prompt
built to follow the index everywhere."""
from __future__ import annotations

import threading

from kvtier.engine import corpus as corpus_
from kvtier.engine.corpus import MAX_DOCUMENTS, WORK_FACTOR, Corpus
from kvtier.planning.blend import MIN_SEGMENT_TOKENS

A = "The river runs north past the old mill and the stone bridge, then east to the sea."
B = "A red fox sleeps under the oak tree near the quiet pond, and wakes at dusk to hunt."
A_LONGER = A + " Boats wait there for the tide."


def _ids(text: str) -> list[int]:  # stands in for a tokenizer: one id per word
    return [hash(w) % 50_000 for w in text.split()]


def _texts(*docs: str) -> list[tuple[str, list[int]]]:
    return [(d, _ids(d)) for d in docs]


def test_documents_are_found_in_order_each_where_it_lies():
    c = Corpus()
    assert c.add(_texts(A, B)) == 2 and len(c) == 2
    assert c.find_text(f"Read these. {B}\n\n{A}\nWhich animal? {A}") == [B, A, A]
    assert c.find_text(f"{A[:-1]}!") == []  # a changed document is not the document
    assert c.find_text("") == [] and c.find_text("short") == []
    assert c.find_text("é" + A + "ü") == [A]


def test_the_longest_document_at_a_position_wins_and_overlaps_are_dropped():
    c = Corpus()
    c.add(_texts(A, A_LONGER))
    assert c.find_text(f"x {A_LONGER} y") == [A_LONGER]
    assert c.find_text(f"x {A} y") == [A]
    tail = A[40:] + " and more words to make it long"
    c.add(_texts(tail))
    assert c.find_text(f"x {A} and more words to make it long") == [A]  # the earlier one is kept


def test_documents_too_short_to_load_are_left_out_and_each_is_kept_once():
    c = Corpus()
    short = " ".join(["word"] * (MIN_SEGMENT_TOKENS - 1))
    assert c.add(_texts(short)) == 0 and len(c) == 0
    assert c.add(_texts(A, A)) == 1 and len(c) == 1


def test_ids_are_found_in_a_prompt_of_ids():
    c = Corpus()
    d1, d2 = list(range(100, 140)), list(range(200, 260))
    c.add([(None, d1), (None, d2)])
    prompt = [1, 2, 3] + d2 + [4] + d1 + [5]
    assert c.find_ids(prompt) == [d2, d1]
    assert c.find_ids(prompt[:-10]) == [d2]  # d1 cut short: not found
    assert c.finder()(prompt) == [d2, d1] and c.finder()(f"x {A}") == []


def test_a_partitions_documents_are_found_in_its_prompts_only_and_every_tenants_in_all():
    c = Corpus()
    c.add(_texts(A))  # every tenant's (--blend-corpus)
    c.add(_texts(B), salt="tenant-a")
    c.add(_texts(A_LONGER + " More."), salt="")  # the default partition's, not every tenant's
    prompt = f"{A} {B} {A_LONGER} More."
    assert c.find_text(prompt, "tenant-a") == [A, B, A]
    assert c.find_text(prompt, "tenant-b") == [A, A]
    assert c.find_text(prompt) == [A, A_LONGER + " More."]


def test_documents_sharing_a_long_opening_are_each_found():
    header = '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"></head>\n<body>\n'
    pages = [header + f"<p>page {i}: " + "lorem ipsum dolor " * (5 + i % 7) + "</p></body></html>" for i in range(300)]
    c = Corpus()
    assert c.add(_texts(*pages)) == 300
    for i in (0, 17, 150, 299):
        assert c.find_text(f"Summarize: {pages[i]} and {B}") == [pages[i]]
    c.add(_texts(B))
    assert c.find_text(f"{pages[150]} then {B}") == [pages[150], B]


def test_at_most_the_documents_a_prompt_may_mark_are_found():
    c = Corpus()
    c.add(_texts(A))
    assert len(c.find_text(f"{A} " * (MAX_DOCUMENTS + 5))) == MAX_DOCUMENTS


def test_a_prompt_that_follows_the_index_everywhere_costs_a_bounded_scan():
    # Forty documents of one repeated character, each differing only at its end, and a long one.
    flood = ["a" * 2000 + f"{i:02d}" for i in range(40)] + ["a" * 60_000]
    tree = corpus_._Tree()
    for d in flood + [A]:
        tree.add(d)
    hostile = "a" * 50_000
    spans, compared = tree.find(hostile)
    # Not 50,000 positions x 2,000 characters: the comparisons stop at the cap.
    assert spans == [] and 0 < compared <= WORK_FACTOR * len(hostile)
    # What the cap cuts off is not found (computed as unmarked text is); after a short run of
    # the same character, or after one copy of a flooding document, the next one is found.
    assert tree.find(hostile + A)[0] == []
    assert tree.find("a" * 100 + " " + A)[0] == [(101, 101 + len(A))]
    assert tree.find(flood[3] + A)[0] == [(0, len(flood[3])), (len(flood[3]), len(flood[3]) + len(A))]
    ids = corpus_._Tree()
    ids.add(tuple([5] * 3000))
    spans, compared = ids.find(tuple([5] * 20_000))
    assert compared <= WORK_FACTOR * 20_000 and spans  # found whole while the budget lasted


def test_adding_while_prompts_are_searched_is_safe():
    c = Corpus()
    c.add(_texts(A))
    errors = []

    def search():
        try:
            for _ in range(200):
                assert len(c) >= 1 and A in c.find_text(f"x {A} y", "t")
        except Exception as e:  # noqa: BLE001 - the test reports any
            errors.append(e)

    t = threading.Thread(target=search)
    t.start()
    for i in range(300):
        c.add(_texts(f"document {i} " + B), salt=f"t{i % 7}")
    t.join()
    assert errors == []


def test_a_prompt_longer_than_the_window_is_not_searched():
    """(refused by its length anyway: a scan of a 4 MB body would cost seconds)"""
    c = Corpus()
    d = list(range(100, 140))
    c.add(_texts(A) + [(None, d)])
    f = c.finder(max_ids=50, max_chars=len(A) + 10)
    assert f.text(A) == [A] and f.text(A + " " * 11) == []
    assert f.ids(d) == [d] and f.ids(d + [0] * 11) == []


def test_the_engines_finder_is_capped_at_its_window():
    from types import SimpleNamespace

    from kvtier.engine import prompts
    from kvtier.engine.config import ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.models.loading import load_model
    from kvtier.planning.blend import BlendOptions

    assert prompts.longest_token_chars(SimpleNamespace(get_vocab=lambda: {"a": 0, "Ġthe": 1, "b": 2})) == 4
    assert prompts.longest_token_chars(None) is None
    model = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    with Engine(model, store="memory:64MB", reuse=ReuseConfig(chunk_tokens=64, blend=BlendOptions())) as engine:
        engine.precompile([list(range(100, 140))])
        f = engine.finder(True, None)
        assert f is not None and f.max_ids == engine.max_model_len and f.max_chars is None  # no vocabulary
