"""The haystacks retrieval items: balanced over kinds and forms, seeded, the asked value at the
token span the diagnosis reads, and scored by whole-value match."""
from __future__ import annotations

import re
from collections import Counter

from kvtier.bench.haystacks import FORMS, HaystackItem, haystack_items, haystacks


def test_items_cycle_over_kinds_and_forms_with_lengths_and_counts_balanced(tok):
    kinds = haystacks()
    assert set(kinds) == {"docstrings", "reference", "code", "table", "dialogue"}  # no wiki without its data
    items = haystack_items(tok, 40, kinds, tuple(FORMS), (256, 512), (1, 2, 3, 4), seed=3)
    assert Counter((it.haystack, it.form) for it in items) == {(h, f): 2 for h in kinds for f in FORMS}
    assert Counter(it.length for it in items) == {256: 20, 512: 20}
    assert Counter(it.facts for it in items) == {1: 10, 2: 10, 3: 10, 4: 10}
    again = haystack_items(tok, 40, kinds, tuple(FORMS), (256, 512), (1, 2, 3, 4), seed=3)
    assert [(a.prefix_ids, a.query_ids, a.answer) for a in items] == [(b.prefix_ids, b.query_ids, b.answer) for b in again]


def test_the_asked_value_sits_at_its_span_and_once_per_fact(tok):
    items = haystack_items(tok, 20, haystacks(), tuple(FORMS), (512,), (1, 2, 3, 4), seed=1)
    for it in items:
        a, b = it.answer_span
        assert tok.decode(it.prefix_ids[a:b]).strip() == it.answer
        text = tok.decode(it.prefix_ids)
        assert text.count(it.answer) == 1  # another fact never answers the question
        statement = re.escape(FORMS[it.form].statement).replace(r"\{key\}", r"[a-z]+").replace(r"\{value\}", ".+?")
        assert len(re.findall(statement, text)) == it.facts  # every fact is in the document, whole
        assert 0.0 <= it.depth <= 1.0 and len(it.slices) == 5


def test_a_value_counts_only_whole():
    item = HaystackItem([], [], "19494", (0, 1), "code", "code", 1, 256, 0.5)
    assert item.correct(" 19494.") and item.correct(" 19,494")
    assert not item.correct(" 194941.") and not item.correct(" 1949")
    phrase = HaystackItem([], [], "amber river willow", (0, 1), "code", "phrase", 1, 256, 0.5)
    assert phrase.correct(" Amber river willow.") and not phrase.correct(" amber river")


def test_the_wiki_haystack_needs_its_data(tmp_path):
    assert "wiki" not in haystacks(tmp_path / "missing.json")
