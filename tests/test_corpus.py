"""Documents found in prompts that mark none (engine/corpus.py): in order, the longest at a
position, per tenant, at a bounded cost on a prompt built to match anchors everywhere."""
from __future__ import annotations

from kvtier.engine import corpus as corpus_
from kvtier.engine.corpus import ANCHOR_CHARS, WORK_FACTOR, Corpus

A = "The river runs north past the old mill and the stone bridge, then east to the sea."
B = "A red fox sleeps under the oak tree near the quiet pond, and wakes at dusk to hunt."
A_LONGER = A + " Boats wait there for the tide."


def test_documents_are_found_in_order_each_where_it_lies():
    c = Corpus()
    assert c.add([A, B]) == 2
    assert c.find_text(f"Read these. {B}\n\n{A}\nWhich animal? {A}") == [B, A, A]
    assert c.find_text(f"{A[:-1]}!") == []  # a changed document is not the document
    assert c.find_text("") == [] and c.find_text("short") == []


def test_the_longest_document_at_a_position_wins_and_overlaps_are_dropped():
    c = Corpus()
    c.add([A, A_LONGER])
    assert c.find_text(f"x {A_LONGER} y") == [A_LONGER]
    assert c.find_text(f"x {A} y") == [A]
    tail = A[40:] + " and more words to make it long"
    c.add([tail])
    assert c.find_text(f"x {A} and more words to make it long") == [A]  # the earlier one is kept


def test_documents_shorter_than_an_anchor_are_not_indexed():
    c = Corpus()
    assert c.add(["x" * (ANCHOR_CHARS - 1)], [[1] * 3]) == 0
    assert len(c) == 0
    assert c.add([A, A]) == 1  # and one document is indexed once


def test_ids_are_found_in_a_prompt_of_ids():
    c = Corpus()
    d1, d2 = list(range(100, 140)), list(range(200, 260))
    c.add(ids=[d1, d2])
    prompt = [1, 2, 3] + d2 + [4] + d1 + [5]
    assert c.find_ids(prompt) == [d2, d1]
    assert c.find_ids(prompt[:-10]) == [d2]  # d1 cut short: not found
    assert c.finder()(prompt) == [d2, d1] and c.finder()(f"x {A}") == []


def test_a_tenants_documents_are_found_in_its_prompts_only_and_every_tenants_in_all():
    c = Corpus()
    c.add([A])  # every tenant's (--blend-corpus)
    c.add([B], salt="tenant-a")
    prompt = f"{A} {B}"
    assert c.find_text(prompt, "tenant-a") == [A, B]
    assert c.find_text(prompt, "tenant-b") == [A]
    assert c.find_text(prompt) == [A]


def test_a_prompt_matching_anchors_everywhere_costs_a_bounded_scan():
    # Forty documents sharing one anchor of a repeated character, each differing only at its end.
    flood = ["a" * 2000 + f"{i:02d}" for i in range(40)]
    index = corpus_._Index(ANCHOR_CHARS)
    for d in flood + [A]:
        index.add(d)
    hostile = "a" * 50_000
    spans, compared = index.find(hostile)
    # Not 50,000 positions x 40 documents x 2,000 characters: the comparisons stop at the cap.
    assert spans == [] and 0 < compared <= WORK_FACTOR * len(hostile)
    # What the cap cuts off is not found (computed as unmarked text is); after a short run of
    # the same character, or after one copy of a flooding document, the next one is found.
    assert index.find(hostile + A)[0] == []
    assert index.find("a" * 100 + " " + A)[0] == [(101, 101 + len(A))]
    assert index.find(flood[3] + A)[0] == [(0, len(flood[3])), (len(flood[3]), len(flood[3]) + len(A))]
    c = Corpus()
    c.add(flood + [A])
    assert c.find_text(hostile + A) == [] and c.find_text(flood[3] + " " + A) == [flood[3], A]
