"""Blend plans and document marking as plain values: exact expected runs, loads and spans."""
from __future__ import annotations

import pytest

from kvtier.engine import documents
from kvtier.engine.prompts import PromptError
from kvtier.planning.blend import BlendOptions, find_segments, merged, pieces, plan_blend, subtract

PROMPT = list(range(100))
SEGMENTS = [(10, 40), (45, 80)]


def test_legolink_recomputes_the_uncovered_tokens_and_each_segments_first_k():
    p = plan_blend(PROMPT, SEGMENTS, 0, 0, BlendOptions(link_tokens=4))
    assert p.runs == ((0, 14), (40, 49), (80, 99))  # the last token is the request's step's
    assert p.loaded == ((14, 40), (49, 80))
    assert (p.recomputed_tokens, p.blended_tokens) == (42, 57)


def test_naive_recomputes_only_what_no_segment_covers():
    p = plan_blend(PROMPT, SEGMENTS, 0, 0, BlendOptions(mode="naive"))
    assert p.runs == ((0, 10), (40, 45), (80, 99)) and p.loaded == ((10, 40), (45, 80))


def test_an_exact_prefix_cuts_a_segment_and_its_link_tokens():
    p = plan_blend(PROMPT, SEGMENTS, 16, 0, BlendOptions(link_tokens=8))
    # segment 0 keeps rows [6, 30): [6, 8) are link tokens; segment 1 whole
    assert p.runs == ((16, 18), (40, 53), (80, 99)) and p.loaded == ((18, 40), (53, 80))
    assert plan_blend(PROMPT, SEGMENTS, 0, 76, BlendOptions()) is None  # under 8 rows left: prefill


def test_every_token_recomputed_when_k_covers_the_segments():
    p = plan_blend(PROMPT, SEGMENTS, 0, 0, BlendOptions(link_tokens=1000))
    assert p.runs == ((0, 99),) and p.loaded == ()


def test_a_segment_ending_the_prompt_leaves_its_last_token_to_the_step():
    p = plan_blend(PROMPT, [(50, 100)], 0, 0, BlendOptions(link_tokens=2))
    assert p.runs == ((0, 52),) and p.loaded == ((52, 99),)


def test_span_arithmetic():
    assert merged([(5, 9), (0, 2), (2, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]
    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    assert subtract([(0, 10)], [(0, 10)]) == [] and subtract([(5, 6)], [(0, 2), (9, 12)]) == [(5, 6)]
    assert pieces([(0, 5), (10, 20), (30, 31)], 4) == [[(0, 4)], [(4, 5), (10, 13)], [(13, 17)], [(17, 20), (30, 31)]]


def test_documents_are_found_by_their_ids_in_order_and_only_aligned():
    assert find_segments([1, 2, 3, 4, 5, 3, 4], [[3, 4], [3, 4], [9]]) == [(2, 4), (5, 7), None]
    assert find_segments([256, 1, 0, 0], [[1]]) == [(1, 2)]  # not the byte inside 256
    assert find_segments([7] * 50_000, [[7] * 49_999 + [8]]) == [None]  # no quadratic scan


@pytest.mark.parametrize("bad", [dict(mode="x"), dict(link_tokens=-1), dict(link_tokens=True), dict(ratio=1.5),
                                 dict(check_layer=-1), dict(score="attention")])
def test_options_are_checked(bad):
    with pytest.raises(ValueError, match=f"blend {next(iter(bad))}"):
        BlendOptions(**bad)


def _encode(text):
    return [ord(c) for c in text] if isinstance(text, str) else list(text)


def test_text_documents_are_tokenized_alone_and_spanned():
    ids, spans = documents.mark(_encode, "sys|alpha|beta|q", ["alpha", "beta"], ())
    assert ids == _encode("sys|alpha|beta|q") and spans == ((4, 9), (10, 14))
    text, docs = documents.split_separated("sys##alpha##beta##q?", "##")
    assert (text, docs) == ("sysalphabetaq?", ["alpha", "beta"])
    with pytest.raises(PromptError, match="document 1"):
        documents.mark(_encode, "sys|alpha", ["alpha", "gamma"], ())
    with pytest.raises(PromptError, match="not both"):
        documents.mark(_encode, "sys", ["s"], [(0, 1)])
