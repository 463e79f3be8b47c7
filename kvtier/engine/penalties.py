"""Repetition, presence and frequency penalties, applied to the tokens a sequence has seen only.

The dense form (a [rows, vocab] count matrix rebuilt from every prompt and output each step) costs
milliseconds per step at batch 8 and grows with the prompt; the tokens a penalty touches are a few
hundred per row. `Seen` keeps them across steps: the prompt's distinct ids once (on the device),
the output's counts updated per token. Meanings are vLLM's and transformers': repetition divides a
positive logit and multiplies a negative one, over prompt and output tokens; frequency (per
occurrence) and presence (once) are subtracted, over output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.request import SamplingParams


class Seen:
    """The tokens one sequence has seen: its prompt's distinct ids and its output's counts."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int] = (), device: torch.device | None = None):
        self._in_prompt = set(prompt)
        self._prompt = torch.tensor(sorted(self._in_prompt), dtype=torch.long, device=device)  # [distinct]
        self._new: list[int] = []  # distinct output tokens the prompt lacks
        self.counts: dict[int, int] = {}
        for t in output:
            self.add(t)

    def add(self, token: int) -> None:
        if token not in self.counts and token not in self._in_prompt:
            self._new.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def tokens(self) -> torch.Tensor:
        """[distinct] ids of the prompt and the output."""
        if not self._new:
            return self._prompt
        return torch.cat([self._prompt, torch.tensor(self._new, dtype=torch.long, device=self._prompt.device)])


def penalize(x: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, Seen]]) -> None:
    """In place on x [n, vocab]: each (row, params, seen) with a penalty gets it, on its seen tokens."""
    dev = x.device
    rep = [(i, p.repetition_penalty, s.tokens()) for i, p, s in rows if p.repetition_penalty != 1.0]
    if rep:
        at = torch.cat([torch.full_like(t, i) for i, _, t in rep])  # [touched]
        tok = torch.cat([t for _, _, t in rep])
        pen = torch.cat([torch.full(t.shape, r, device=dev) for _, r, t in rep])
        v = x[at, tok]
        x[at, tok] = torch.where(v > 0, v / pen, v * pen)
    sub = [(i, t, p.frequency_penalty * c + p.presence_penalty) for i, p, s in rows
           if p.frequency_penalty or p.presence_penalty for t, c in s.counts.items()]
    if sub:
        at_l, tok_l, val = zip(*sub)
        x.index_put_((torch.tensor(at_l, device=dev), torch.tensor(tok_l, device=dev)),
                     -torch.tensor(val, device=dev), accumulate=True)
