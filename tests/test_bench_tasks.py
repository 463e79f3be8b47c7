"""The offline accuracy tasks: what each item holds, asks and accepts (SmolLM2's tokenizer, which
every preset shares)."""
from __future__ import annotations

from kvtier.bench.tasks import FACT_KINDS, needle_items, retrieval_items


def test_retrieval_items_plant_every_fact_once_and_ask_for_one(tok):
    items = retrieval_items(tok, 12, lengths=(256, 512), seed=3)
    assert [i.facts for i in items[:4]] == [1, 4, 1, 4]  # cycling over (length, facts)
    assert items[0].doc_tokens < 400 < items[2].doc_tokens
    assert [i.kind for i in items] == ["code"] * 4 + ["number"] * 4 + ["name"] * 4
    for item in items:
        doc = tok.decode(item.prefix_ids)
        kind = FACT_KINDS[item.kind]
        assert doc.count(" vault ") == item.facts, doc  # one sentence per fact
        assert doc.count(item.answer) == 1  # the asked value is planted once, the others differ
        question = tok.decode(item.query_ids)
        key = question.split(" vault")[0].split()[-1]
        statement = kind.statement.format(key=key, value=item.answer)
        assert statement in doc, statement  # the asked key's fact holds the answer
        assert question.rstrip().endswith(kind.answer_prefix.format(key=key))
        assert tok.decode(item.summary_ids).strip().startswith("Summarize the text above")
    again = retrieval_items(tok, 12, lengths=(256, 512), seed=3)
    assert [(i.prefix_ids, i.query_ids, i.answer) for i in again] == [(i.prefix_ids, i.query_ids, i.answer) for i in items]


def test_a_retrieval_answer_is_right_when_it_holds_the_value_exactly(tok):
    item = retrieval_items(tok, 1, lengths=(256,), facts=(1,))[0]
    value = item.answer
    assert item.correct(f" {value}.") and item.correct(f" {value[:2]},{value[2:]} gold coins.")
    assert not item.correct(f" {value[:-1]}.") and not item.correct(" nothing")


def test_needle_items_plant_the_word_once_at_their_depth(tok):
    for item in needle_items(tok, 5, lengths=(512,)):
        doc = tok.decode(item.prefix_ids)
        assert doc.count("The secret word is ") == 1
        where = doc.index("The secret word is ") / len(doc)
        assert abs(where - item.depth) < 0.2, (where, item.depth)
        assert len(item.choices) == 4 and 0 <= item.answer < 4
