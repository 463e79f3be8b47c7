"""Row-invariant linear layers: a token's output bits do not depend on the other rows of the call.

A GEMM library picks its blocking from the problem's shape, and a different blocking sums a
row's products in a different order. On the CPU this is real: oneDNN's bf16 AMX kernels give a
row different bits for M = 1..32, 33..767 and >= 768 rows of the same input, and MKL's fp32 path
does so below 16 rows. So a prompt prefilled in one piece, the same prompt split into chunks, a
cache hit that computes only the suffix and a decode batched with others would all compute the
same token differently, and in bf16 that changes greedy answers.

What is invariant here (measured, and checked at first use for each weight shape, dtype and
thread count, every row count up to the plan's chunk; what a check found is kept under
KVTIER_HOME per machine and build): oneDNN's matmul on a weight packed once
(`mkldnn._reorder_linear_weight`) in calls of `min_rows` to `chunk` rows. A step's rows are cut
into calls of at most `chunk` rows and a short call is padded to `min_rows` (1: not padded, where
that was checked to hold), so every row meets kernel configurations that agree. Where no
candidate passes, every call is padded to exactly `FIXED.chunk` rows (one shape: invariant by
construction, slower).

Linears that read the same input (q, k and v; gate and up) run as one call over their weights
concatenated (`Fused`): at a step's sizes a oneDNN call's fixed cost is as large as its arithmetic,
so three narrow GEMMs cost about twice one GEMM of their combined width.

CUDA and a model whose kernels are not exact (`Kernels.exact`, `--fast-inexact`) use plain
`F.linear`, one call per linear: `Linear.exact` is set by its model (`CausalLM.set_kernels`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Generator, Sequence
from dataclasses import astuple, dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RowPlan:
    """How a linear's rows are cut into kernel calls: at most `chunk` rows per call, a shorter call
    padded to `min_rows` (chunk == min_rows: every call has the same shape)."""

    chunk: int
    min_rows: int
    pack_hint: int = 1  # the row count oneDNN packs the weight for (its layout, hence speed and bits)


# Candidate plans, fastest first: larger calls pay the per-call overhead less often, and short
# calls unpadded where that holds: a decode of one sequence then runs oneDNN's one-row kernel,
# which streams the weights (faster than padding to 8 rows: docs/benchmarks.md, "one-row linears
# unpadded"), where AMX's bf16 kernels give rows 1..32 other bits and fall back to
# padding. A plan is used for a weight once every row count from 1 to its chunk (and rows at an
# offset) has been checked to give the bits one full call gives. The check's cost grows with the
# square of the chunk (seconds for calls of 512 rows on a small CPU, an order more than for 128), so
# a weight's first use checks calls of up to QUICK rows only, and the larger calls are checked later,
# a row count at a time while the engine has nothing to serve (`refine`; `kvtier profile` does it
# at once). A larger plan with the same padding and pack gives the same bits (its check covers
# every call the quick plan makes), so it is adopted in place. An LM head (a wide output) is
# checked up to 64 rows only: a step rarely samples more rows. FIXED is one call shape: invariant
# by construction, the fallback.
CANDIDATES = tuple(RowPlan(chunk, min_rows, hint) for chunk in (512, 256, 128, 64) for min_rows in (1, 8)
                   for hint in (8, 1))
FIXED = RowPlan(chunk=32, min_rows=32)
QUICK = 128  # the largest calls checked before a weight's first call
_WIDE = 8192  # output features from which a weight is an LM head here
# Below this many elements (test models) a weight's calls are cheap however padded: FIXED without a check (the
# check's cost is mostly oneDNN building a kernel per row count, which a test model pays per process).
_SMALL = 1 << 16

_plans: dict[tuple, RowPlan] = {}
# Weights on a quick plan whose larger calls are still to be checked: key -> (weight, bias, plan).
_pending: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, RowPlan]] = {}
_generation = 0  # bumped when a plan is replaced: Linear and Fused look their plans up again
_packing = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def _pack(weight: torch.Tensor, hint: int) -> torch.Tensor | None:
    if not _packing:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    except RuntimeError as e:  # a dtype this build's oneDNN does not pack
        log.info("no packed weight for %s: %s", weight.dtype, e)
        return None


def _call(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None, bias: torch.Tensor | None,
          plan: RowPlan) -> torch.Tensor:
    """x [rows, in] -> [rows, out] in calls of plan.min_rows..plan.chunk rows (on `packed`, else `weight`)."""
    outs = []
    for a in range(0, x.shape[0], plan.chunk):
        part = x[a : a + plan.chunk]
        m = part.shape[0]
        if m < plan.min_rows:
            part = F.pad(part, (0, 0, 0, plan.min_rows - m))  # [min_rows, in]
        if packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(part, packed, bias, "none", [None], "")
        else:
            assert weight is not None  # kept wherever there is no pack
            y = F.linear(part, weight, bias)
        outs.append(y[:m])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _plan_for(weight: torch.Tensor, bias: torch.Tensor | None) -> RowPlan:
    key = (tuple(weight.shape), weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _plans:
        if weight.numel() < _SMALL:
            _plans[key] = FIXED
            return FIXED
        known = _checked(key)
        if known is not None:
            _plans[key] = known
            return known
        wide = weight.shape[0] >= _WIDE
        tries = [p for p in CANDIDATES if (p.chunk <= 64 if wide else 64 < p.chunk <= QUICK)]
        plan = _plans[key] = next((p for p in tries if _holds(p, weight, _pack(weight, p.pack_hint), bias)), FIXED)
        if plan is FIXED:
            log.warning("linear %s %s: rows not invariant in calls of up to %d rows here; every call padded to "
                        "%d rows (slower)", tuple(weight.shape), weight.dtype, tries[-1].chunk, FIXED.chunk)
        if plan is FIXED or wide:
            _remember(key, plan)
        else:
            _pending[key] = (weight, bias, plan)
    return _plans[key]


def has_pending() -> bool:
    """Whether some weight's larger calls are still to be checked (`refine`)."""
    return bool(_pending)


def refine() -> Generator[None, None, None]:
    """Check larger calls for every weight on a quick plan, yielding after each row count (an
    engine runs this while idle, so a request arriving waits for one kernel call at most). A
    larger plan that holds replaces the quick one in place (the same bits, larger calls); what was
    found is kept under KVTIER_HOME, so the next process starts on it."""
    global _generation
    while _pending:
        key = next(iter(_pending))
        weight, bias, quick = _pending.pop(key)
        final = quick
        for chunk in (c for c in dict.fromkeys(p.chunk for p in CANDIDATES) if c > quick.chunk):
            bigger = RowPlan(chunk, quick.min_rows, quick.pack_hint)
            if (yield from _check(bigger, weight, _pack(weight, bigger.pack_hint), bias)):
                final = bigger
                break
        if final != quick and _plans.get(key) == quick:
            _plans[key] = final
            _generation += 1
        _remember(key, final)


# What the checks found is kept under KVTIER_HOME, so a process does not pay them again (seconds of
# every start): keyed by the weight's shape, dtype, bias and threads, and by all that
# decides which kernels oneDNN runs (torch's version, which bundles it; the CPU's model and flags;
# an ISA cap in the environment), so another machine or build checks afresh. Only a plan that is
# one of this module's candidates is taken from the file; anything else there is ignored.
_CHECK_VERSION = 3  # bump when what a check proves or which plans it tries changes
# Rows each row count is checked on: a kernel that sums a short call's rows in another order shows
# it in few of a row's outputs once rounded (an fp16 row of SmolLM2's down_proj: 2 of 576 on an
# Intel Xeon with AMX), so one call of one row may miss what 64 rows show.
CHECK_ROWS = 64


@lru_cache(maxsize=1)
def _machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("flags")), "")
        cpu = f"{cpu} {model} {' '.join(sorted(set(flags.split())))}"
    except OSError:
        pass
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return f"v{_CHECK_VERSION} torch {torch.__version__} isa-cap {isa} {cpu}"


def _cache_path() -> str:
    from kvtier import paths

    return os.path.join(paths.home(), "linear_plans.json")


def _entry(key: tuple) -> str:
    shape, dtype, bias, threads = key
    return f"{shape} {dtype} bias={bias} threads={threads}"


def _load() -> dict:
    try:
        with open(_cache_path()) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc.get(_machine(), {}) if isinstance(doc, dict) and isinstance(doc.get(_machine(), {}), dict) else {}


def _checked(key: tuple) -> RowPlan | None:
    """The plan an earlier process's check found for `key` on this machine and build, if any."""
    row = _load().get(_entry(key))
    plans = {astuple(p): p for p in (*CANDIDATES, FIXED)}
    return plans.get(tuple(row)) if isinstance(row, list) else None


def _remember(key: tuple, plan: RowPlan) -> None:
    path = _cache_path()
    try:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        mine = doc.get(_machine())
        doc[_machine()] = {**(mine if isinstance(mine, dict) else {}), _entry(key): list(astuple(plan))}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
    except OSError as e:  # a read-only home: the next process checks again
        log.info("could not keep the linear plans in %s: %s", path, e)


def _holds(plan: RowPlan, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Every row count 1..chunk, at offsets covering CHECK_ROWS rows or more, gives the rows one
    full call gives, bit for bit."""
    slices = _check(plan, weight, packed, bias)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return bool(done.value)


def _check(plan: RowPlan, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
           ) -> Generator[None, None, bool]:
    """`_holds`, yielding after each row count."""
    g = torch.Generator().manual_seed(0)
    n = plan.chunk
    x = torch.randn(2 * n, weight.shape[1], generator=g).to(weight.dtype)  # [2 chunk, in]
    ref = torch.cat([_call(x[:n], weight, packed, bias, plan), _call(x[n:], weight, packed, bias, plan)])
    for m in range(1, n + 1):
        for c in range(-(-CHECK_ROWS // m)):
            at = (m * 7919 + c * m) % n  # a different offset per count and call
            if not torch.equal(_call(x[at : at + m], weight, packed, bias, plan), ref[at : at + m]):
                return False
        yield
    return True


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) whose output rows are row-invariant on
    the CPU. The packed copy of the weight is built on first use and rebuilt if the weight changes."""

    exact = True  # row-invariant on the CPU; False: plain F.linear (its model's `Kernels.exact`)
    _packed: torch.Tensor | None = None
    _plan: RowPlan = FIXED
    _packed_of: tuple[int, int, torch.dtype, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not self.exact or w.device.type != "cpu":
            return F.linear(x, w, self.bias)
        # The thread count too: a plan holds for the count it was checked at (oneDNN may split a
        # reduction across threads by the call's shape), so a process that changes it checks again.
        ident = (w.data_ptr(), w._version, w.dtype, torch.get_num_threads(), _generation)
        if self._packed_of != ident:
            self._plan = _plan_for(w.detach(), self.bias)
            self._packed, self._packed_of = _pack(w.detach(), self._plan.pack_hint), ident
        shape = x.shape
        y = _call(x.reshape(-1, shape[-1]), w, self._packed, self.bias, self._plan)
        return y.view(*shape[:-1], y.shape[-1])


class Fused:
    """Linears over one input as one kernel call (exact CPU path): the parts' weights (and biases)
    concatenated and packed once, repacked when any part's weight changes, the output split into
    the parts' column views. The parameters stay the parts' own, so state dicts, loaders and the
    plain path (CUDA, inexact: one call per part) are unchanged.

    `tail(x, first)` computes only the parts from `first` on (HCache rebuilds K and V without Q).
    It must give the bits the whole call gives those columns, or a restore would differ from the
    forward it stands in for: it runs as its own call only where that was checked (once per pair
    of shapes, dtype and thread count, as the row plans are); else the whole call runs and the
    leading parts are dropped."""

    def __init__(self, *parts: Linear) -> None:
        self.parts = parts
        self._packs: dict[int, tuple[tuple, _Packed]] = {}  # first part -> (weights' identity, pack)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> one output [..., out_i] per part (views of one buffer on the exact path)."""
        return self.tail(x, 0)

    def tail(self, x: torch.Tensor, first: int) -> list[torch.Tensor]:
        parts = self.parts[first:]
        if not parts[0].exact or parts[0].weight.device.type != "cpu" or len({p.bias is None for p in parts}) > 1:
            return [p(x) for p in parts]
        pack = self._pack(first)
        if first and not pack.agrees_with(self._pack(0), sum(p.out_features for p in self.parts[:first])):
            return self.tail(x, 0)[first:]
        shape = x.shape
        y = _call(x.reshape(-1, shape[-1]), pack.weight, pack.packed, pack.bias, pack.plan)  # [rows, sum out_i]
        return [o.view(*shape[:-1], o.shape[-1]) for o in y.split([p.out_features for p in parts], dim=-1)]

    def _pack(self, first: int) -> "_Packed":
        parts = self.parts[first:]
        ident = (torch.get_num_threads(), _generation,
                 *((p.weight.data_ptr(), p.weight._version, p.weight.dtype) for p in parts))
        held = self._packs.get(first)
        if held is None or held[0] != ident:
            held = ident, _Packed.of(parts)
            self._packs[first] = held
        return held[1]


@dataclass
class _Packed:
    """A concatenated weight's oneDNN pack and row plan (the plain weight kept only where oneDNN
    does not pack it)."""

    weight: torch.Tensor | None
    packed: torch.Tensor | None
    bias: torch.Tensor | None
    plan: RowPlan
    out_features: int
    in_features: int
    dtype: torch.dtype

    @staticmethod
    def of(parts: Sequence[Linear]) -> "_Packed":
        w = torch.cat([p.weight.detach() for p in parts])  # [sum out_i, in]
        bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
        plan = _plan_for(w, bias)
        packed = _pack(w, plan.pack_hint)
        return _Packed(w if packed is None else None, packed, bias, plan, w.shape[0], w.shape[1], w.dtype)

    def agrees_with(self, whole: "_Packed", offset: int) -> bool:
        """Whether this pack's output equals columns [offset, offset + out) of `whole`'s, bit for
        bit, on two full calls of random rows (what kernels the calls use depends on the shapes,
        as the row plans do, so it is checked once per pair of shapes)."""
        key = (self.out_features, whole.out_features, offset, self.in_features, self.dtype,
               self.bias is not None, torch.get_num_threads())
        if key not in _agree:
            g = torch.Generator().manual_seed(1)
            n = 2 * max(self.plan.chunk, whole.plan.chunk)
            x = torch.randn(n, self.in_features, generator=g).to(self.dtype)  # [n, in]
            mine = _call(x, self.weight, self.packed, self.bias, self.plan)
            theirs = _call(x, whole.weight, whole.packed, whole.bias, whole.plan)[:, offset : offset + mine.shape[1]]
            _agree[key] = torch.equal(mine, theirs)
            if not _agree[key]:
                log.info("linear %s %s: a part's own call rounds otherwise than the fused call; computing the "
                         "whole", (mine.shape[1], self.in_features), self.dtype)
        return _agree[key]


_agree: dict[tuple, bool] = {}
