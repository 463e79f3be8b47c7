"""The oracle bounds of `kvtier bench impress --tasks haystacks`: per layer, the granules that full
KV's own attention reads most, kept at the defaults' ratio, unit and pooling window.

Two oracles score the stored prefix with full KV's attention at every layer, which no restore
can see (it would need every key, and the answer before it is decoded):

answer    the rows that predict full KV's answer (the question's last token, then the answer's
          tokens): what full KV read to answer.
question  every new row (the chat turn and the question): H2O's scorer over the whole prefix in
          every layer, with full KV's hidden states rather than the restore's own.

A selection of the same size that loses more than the answer oracle has its scorer to blame; where
the answer oracle loses as much, the share kept is the likelier bound than the scorer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.impress.importance import select_all
from kvtier.engine.impress.policy import ImpressPolicy, Selection
from kvtier.engine.impress.select import Units
from kvtier.models.attention import causal_attention, column_importance
from kvtier.models.kernels import Kernels
from kvtier.models.llama import CausalLM, LayerAttention
from kvtier.models.rope import Rope

ORACLES = ("answer", "question")


def oracle_kind(name: str) -> str | None:
    """`oracle-answer-g-w17@0.25` -> "answer"; None for a row that is not an oracle."""
    head = name.split("@")[0]
    return next((o for o in ORACLES if head.startswith(f"oracle-{o}-")), None)


def oracle_variants(ratios: Sequence[float], granule: int, window: int) -> dict[str, ImpressPolicy]:
    """Each oracle at each ratio, in the defaults' units (whole granules) and pooling window."""
    return {f"oracle-{o}-g-w{window}@{r:g}": ImpressPolicy(ratio=r, selection=Selection.GIVEN, block=granule,
                                                            window=window)
            for r in ratios for o in ORACLES}


@dataclass(frozen=True)
class FullAttention:
    """Per layer, the column sums of full KV's attention over the prefix [heads, m], from the rows
    that predict the answer and from every new row."""

    answer: list[torch.Tensor]
    question: list[torch.Tensor]

    def sets(self, kind: str, policy: ImpressPolicy) -> list[torch.Tensor]:
        """Each layer's kept tokens [kept] ascending: the policy's units ranked by this importance."""
        imp = self.answer if kind == "answer" else self.question
        m, layers = imp[0].shape[1], len(imp)
        out = []
        for li, layer_imp in enumerate(imp):
            units = Units(m, policy.unit, *policy.units(m, li, layers), policy.window)
            out.append(units.tokens(select_all(units.pooled(layer_imp), units.kept).tokens))
        return out


class _Scoring(LayerAttention):
    """The new rows over the whole prefix (exact attention), each layer's importance recorded."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], questions: int, cos: torch.Tensor,
                 sin: torch.Tensor, kernels: Kernels) -> None:
        self.k, self.v, self.questions, self.cos, self.sin, self.kernels = k, v, questions, cos, sin, kernels
        self.answer: list[torch.Tensor] = []
        self.question: list[torch.Tensor] = []

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor) -> torch.Tensor:
        kp = self.k[li]  # [m, kv_heads, hd]
        m, s = kp.shape[0], self.questions - 1  # row s predicts the answer's first token
        self.question.append(column_importance(q[: self.questions], kp, kn[: self.questions]))  # [heads, m]
        seen = torch.cat([kp, kn[:s]])  # what the answer's rows see before their own keys
        self.answer.append(column_importance(q[s:], seen, kn[s:])[:, :m])  # [heads, m]
        return causal_attention(q, torch.cat([kp, kn]), torch.cat([self.v[li], vn]), m, self.kernels)


@torch.inference_mode()
def full_attention(model: CausalLM, rope: Rope, k: list[torch.Tensor], v: list[torch.Tensor], new: Sequence[int],
                   answer: Sequence[int]) -> FullAttention:
    """Full KV's attention over the prefix (k, v per layer [m, kv_heads, hd]) of `new` then `answer`."""
    ids = [*new, *answer]
    m, dev = k[0].shape[0], rope.cos_h.device
    cos, sin = rope.halves(torch.arange(m, m + len(ids), device=dev))  # [n, 1, hd/2]
    scoring = _Scoring(k, v, len(new), cos, sin, model.kernels)
    model.run_layers(model.embed(torch.tensor(ids, dtype=torch.long, device=dev)), scoring)
    return FullAttention(scoring.answer, scoring.question)
