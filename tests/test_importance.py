"""The IMPRESS selection mechanics on hand-made inputs, with the paper's worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.engine.impress.importance import (
    jaccard,
    mean_pairwise_jaccard,
    random_jaccard,
    select,
    select_all,
    similarity_threshold,
    top_k,
    vectors_read,
    vote,
)
from kvtier.models.attention import column_importance


def test_jaccard_of_the_papers_figure_7a():
    assert jaccard({0, 2}, {0, 1}) == pytest.approx(1 / 3)
    assert mean_pairwise_jaccard([torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([0, 2])]) == \
        pytest.approx((1 / 3 + 1 + 1 / 3) / 3)


@pytest.mark.parametrize("ratio, j, t", [(0.5, 0.333, 0.517), (0.4, 0.250, 0.435), (0.25, 0.143, 0.311),
                                         (0.1, 0.053, 0.171), (0.05, 0.026, 0.111)])
def test_threshold_table(ratio, j, t):
    assert random_jaccard(ratio) == pytest.approx(j, abs=5e-4)
    assert similarity_threshold(ratio, 0.6) == pytest.approx(t, abs=5e-4)


def test_threshold_rejects_a_ratio_outside_0_1():
    with pytest.raises(ValueError, match="importance ratio"):
        similarity_threshold(0.0)


def test_column_importance_is_the_softmax_column_sum():
    # One head, hd 1, q = 1: scores are the keys. Prefix keys 0, ln 3 and the row's own key 0:
    # weights 1/5, 3/5 (prefix) and 1/5 (own), so the prefix importance is [0.2, 0.6].
    q = torch.ones(1, 1, 1)
    k_prefix = torch.tensor([[[0.0]], [[math.log(3)]]])  # [2, 1, 1]
    imp = column_importance(q, k_prefix, torch.zeros(1, 1, 1))
    assert imp.shape == (1, 2)
    assert imp[0].tolist() == pytest.approx([0.2, 0.6])
    # Without own keys the prefix takes all the weight.
    assert column_importance(q, k_prefix)[0].tolist() == pytest.approx([0.25, 0.75])


def test_column_importance_sums_rows_and_respects_causality_and_gqa():
    # Two rows, two query heads over one KV head (GQA); row 0 must not see row 1's own key.
    q = torch.tensor([[[1.0], [2.0]], [[1.0], [2.0]]])  # [n=2, heads=2, hd=1]
    k_prefix = torch.tensor([[[0.0]]])  # [1, 1, 1]
    k_own = torch.tensor([[[0.0]], [[100.0]]])  # row 1's own key dominates row 1 only
    imp = column_importance(q, k_prefix, k_own)
    # Row 0 (both heads): prefix vs own key 0, both score 0 -> 1/2. Row 1: the own key 100*q wins -> ~0.
    assert imp.shape == (2, 1)
    assert imp[:, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    # Against an explicit softmax with the causal mask.
    for h in range(2):
        rows = []
        for i in range(2):
            keys = torch.cat([k_prefix[:, 0, 0], k_own[: i + 1, 0, 0]])
            rows.append(torch.softmax(q[i, h, 0] * keys, dim=0)[0])
        assert imp[h, 0].item() == pytest.approx(sum(rows).item(), abs=1e-6)


def test_top_k_picks_the_largest_ascending_and_breaks_ties_by_position():
    assert top_k(torch.tensor([0.1, 0.5, 0.2, 0.5, 0.0]), 2).tolist() == [1, 3]
    assert top_k(torch.tensor([0.3, 0.1, 0.3, 0.3]), 2).tolist() == [0, 2]
    assert top_k(torch.tensor([0.3, 0.1]), 5).tolist() == [0, 1]


def test_vote_prefers_majority_tokens_then_fills_by_summed_importance():
    imp = torch.tensor([
        [0.9, 0.8, 0.0, 0.0, 0.1],  # top-2 {0, 1}
        [0.9, 0.0, 0.7, 0.0, 0.1],  # top-2 {0, 2}
        [0.0, 0.0, 0.6, 0.0, 2.0],  # top-2 {2, 4}: 4 has the largest sum (2.2) but one vote
    ])
    assert vote(imp, 2).tolist() == [0, 2]  # both in two sets
    assert vote(imp, 3).tolist() == [0, 2, 4]  # then the largest summed importance
    assert vote(imp[:1], 2).tolist() == [0, 1]  # one probe: its own top-k


def test_select_passes_when_probes_agree_and_falls_back_when_they_do_not():
    agree = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 4.0, 0.1, 0.0], [4.0, 5.0, 0.0, 0.1]])
    sel = select(agree, 2, similarity_threshold(0.5))
    assert sel is not None and sel.passed and sel.jaccard == 1.0 and sel.tokens.tolist() == [0, 1]
    disagree = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.0], [0.0, 5.0, 4.0, 0.0]])
    # top-2 sets {0,1}, {2,3}, {1,2}: J = (0 + 1/3 + 1/3) / 3 = 0.222 < t(0.5) = 0.517
    assert select(disagree, 2, similarity_threshold(0.5)) is None
    every = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.0, 2.0, 0.0, 0.0]])
    fb = select_all(every, 2, 0.222)
    assert not fb.passed and fb.tokens.tolist() == [1, 3]


def test_vectors_read_of_the_papers_figure_9():
    # 32 heads, 4 tokens, 1 important, 3 probes. Without identification: every key and the kept
    # token's values, 128 + 32 = 160 vectors. With it the paper counts 12 + 64 = 76 (it reads the
    # probe heads' kept keys again); the probe keys are already here, so 73.
    assert vectors_read(32, 4, 1, 3, passed=False) == 160
    assert vectors_read(32, 4, 1, 3, passed=True) == 73
    # SmolLM2's GQA: 3 KV heads, one probe: a third of the keys, then the kept share.
    assert vectors_read(3, 64, 16, 1, passed=True) == 64 + 2 * 16 + 3 * 16


def test_select_with_the_sum_rule_ranks_by_summed_probe_importance():
    imp = torch.tensor([[0.9, 0.8, 0.0, 0.0, 0.1], [0.9, 0.0, 0.7, 0.0, 0.1], [0.0, 0.0, 0.6, 0.0, 2.0]])
    # Majority: {0, 2} (each in two sets); sum: 4 (2.2) then 0 (1.8).
    assert select(imp, 2, 0.0).tokens.tolist() == [0, 2]
    assert select(imp, 2, 0.0, rule="sum").tokens.tolist() == [0, 4]
