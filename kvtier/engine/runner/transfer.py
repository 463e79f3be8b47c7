"""Copies between host memory and the device the engine runs on: one interface, two back ends.

Every host<->device copy of the restore and saving paths goes through a `Transfer`:

    to_device(dst, src)  enqueue host pieces -> device pieces; -> a Handle
    to_stage(stage, runs) contiguous host byte runs into one device byte buffer: one batched
                         submission (a restore's DMA of a layer group of every chunk)
    scatter(dst, idx, src) dst[idx] = src on the compute stream (placing staged rows in the pool)
    stage(src)           the same into fresh device tensors (hidden states to project, rows to remap)
    upload_views(src)    host views -> device views alike, one copy per host buffer and no scatter
    upload_runs(runs)    host byte runs into a fresh device buffer, one batched submission (a blend's
                         stored chunks of a read group, packed on the device after)
    to_host(src)         enqueue device pieces -> fresh host tensors (pinned on CUDA); -> a Handle
    wait(handle)         make the compute stream wait for it (no host sync)
    sync(handle)         block the host until it is done (a staging buffer may then be reused,
                         a snapshot may be read)

The CPU back end copies at once and its handles are always done. The CUDA back end owns a
host-to-device and a device-to-host stream: copies run on the copy engines beside the compute
kernels, each batch of copies ends in an event, and the compute stream waits on the event of the
layer it needs (CachedAttention §3.2, HCache §4.2). A copy stream first waits for the compute
stream's current point, so a pool block freed by an earlier request is not overwritten while a
queued kernel still reads it. `LazyTransfer` is for tests on the CPU: its copies deliver NaN until
someone waits on them, so a missing wait makes restore-equals-recompute tests fail without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from kvtier.store.reads import storage_bytes

log = logging.getLogger(__name__)


@dataclass
class Handle:
    """One batch of enqueued copies. `event` is a CUDA event; `pending` holds a lazy back end's
    copies not yet performed; a handle with neither is done."""

    event: torch.cuda.Event | None = None
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


DONE = Handle()


def joined(first: Handle, then: Handle) -> Handle:
    """Two batches of copies enqueued one after the other on the same copy stream, as one handle:
    the later batch's event covers both; a lazy back end's pending copies are both batches'."""
    if first is DONE or then is DONE:
        return then if first is DONE else first
    return Handle(event=then.event if then.event is not None else first.event, pending=first.pending + then.pending)


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class EqualRuns:
    """`to_stage` runs of one length, as arrays: run i copies `nbytes` bytes of host storage
    buffers[buffer[i]] from byte src[i] to the stage at byte dst[i]. A restore's layer group of
    every whole chunk is one of these, so the CUDA back end hands the driver their addresses
    without a Python object per run."""

    buffers: Sequence[torch.Tensor]  # uint8 host storages (kept alive by the caller until done)
    buffer: np.ndarray  # int64 [runs]
    src: np.ndarray  # int64 [runs]
    dst: np.ndarray  # int64 [runs]
    nbytes: int

    def __len__(self) -> int:
        return len(self.dst)

    def pairs(self) -> list[tuple[int, torch.Tensor]]:
        """As `to_stage`'s (offset, host bytes) runs."""
        n = self.nbytes
        return [(d, self.buffers[b][s:s + n]) for b, s, d in zip(self.buffer.tolist(), self.src.tolist(), self.dst.tolist())]

    def addresses(self) -> np.ndarray:
        """Host address of each run's first byte."""
        return np.array([b.data_ptr() for b in self.buffers], dtype=np.int64)[self.buffer] + self.src


def all_runs(runs: Sequence[tuple[int, torch.Tensor]], equal: EqualRuns | None) -> Sequence[tuple[int, torch.Tensor]]:
    """`runs` and `equal`'s runs as one list of (offset, host bytes): for back ends that copy run by run."""
    return [*runs, *equal.pairs()] if equal is not None and len(equal) else runs


class Transfer:
    """The synchronous back end (the CPU's): every copy happens when it is asked for. On another
    device it is correct but serial (what tests run a fake device with)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @property
    def is_async(self) -> bool:
        return False

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        if self.device.type == "cpu":
            if dst:
                torch._foreach_copy_(list(dst), list(src))
        else:
            for d, s in zip(dst, src):
                d.copy_(s.to(d.device, non_blocking=True))
        return DONE

    def stage(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        out = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in src]
        return out, self.to_device(out, src)

    def upload_views(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        """Host views (strided: parts of a layer group of stored chunks) as device views of the same
        shapes and strides: the span of each host buffer under them goes over in one copy (one
        batched submission for all), and the views are made on the copied bytes, so a group's
        layers of one chunk stay views of one buffer at an even stride. The sources must stay
        untouched until the handle is done. On the CPU: the sources themselves."""
        if self.device.type == "cpu":
            return list(src), DONE
        return self.packed_upload(src)

    def packed_upload(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        """`upload_views`' copies, on any device (the CPU's tests take this path too)."""
        runs, nbytes = span_runs(src)
        stage, handle = self.upload_runs(runs, nbytes)
        return packed_views(stage, src), handle

    def upload_runs(self, runs: Sequence[tuple[int, torch.Tensor]], nbytes: int) -> tuple[torch.Tensor, Handle]:
        """Host byte runs (offset, contiguous uint8) into a fresh device byte buffer of `nbytes`,
        in one batched submission. The sources must stay untouched until the handle is done, and
        the buffer is read only after it (`wait` or `sync`)."""
        stage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return stage, self.to_stage(stage, runs)

    def to_stage(self, stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]],
                 equal: EqualRuns | None = None) -> Handle:
        """Host byte runs into the device byte buffer `stage` (uint8): runs[i] = (byte offset in
        `stage`, a contiguous host uint8 tensor), and the runs of `equal`. The sources must stay
        untouched until the handle is done."""
        runs = all_runs(runs, equal)
        return self.to_device([stage[o:o + r.numel()] for o, r in runs], [r for _, r in runs])

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """dst[index] = src, one kernel on the compute stream (`src` may be any strided view)."""
        dst.index_put_((index,), src)

    def to_host(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        # On the CPU these are already host tensors: views, nothing copied.
        return [s.to("cpu") for s in src], DONE

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor (indices) on the device, without a host sync."""
        return t.to(self.device, non_blocking=True)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer fit for asynchronous copies (pinned on CUDA)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def wait(self, handle: Handle) -> None:
        pass

    def sync(self, handle: Handle) -> None:
        pass

    def done(self, handle: Handle) -> bool:
        """Finished, without waiting (a source buffer may be reused)."""
        return True

    def sync_compute(self) -> None:
        """Block the host until the compute stream has run everything enqueued so far (timings,
        and Cake's pointers, follow real device progress, not the host's enqueue speed)."""

    def mark(self, copy: bool) -> torch.cuda.Event | None:
        """A timing mark on the copy stream (or the compute stream); None where there are no streams."""
        return None


class CudaTransfer(Transfer):
    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self.pin = _can_pin()

    @property
    def is_async(self) -> bool:
        return True

    def _enqueue(self, stream: torch.cuda.Stream, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return Handle(event=ev)

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        """Host views (strided: a layer group of stored chunks) into device views (strided: pool
        slots). A strided host source would make PyTorch stage it through pageable memory with a
        blocking copy, so instead each host buffer's span under the sources goes over in one
        contiguous DMA copy, and the strided scatter into `dst` runs on the device, on the same
        stream, before the event."""
        if not dst:
            return DONE
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            spans = _spans(src)
            sizes = [-(-(hi - lo) // _ALIGN) * _ALIGN for _, lo, hi, _ in spans]
            stage = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # [bytes of every span]
            dma_dst, dma_src, targets, views, pos = [], [], [], [], 0
            for (first, lo, hi, idx), n in zip(spans, sizes):
                dma_dst.append(stage[pos:pos + hi - lo])
                dma_src.append(storage_bytes(first)[lo:hi])
                for i in idx:
                    a, b = byte_range(src[i])
                    views.append(stage[pos + a - lo:pos + b - lo].view(src[i].dtype).as_strided(src[i].shape,
                                                                                                src[i].stride()))
                    targets.append(dst[i])
                pos += n
            # C++ loops, not Python ones: a restore issues thousands of these.
            torch._foreach_copy_(dma_dst, dma_src, non_blocking=True)  # one DMA per host buffer
            torch._foreach_copy_(targets, views, non_blocking=True)  # the strided scatter, on the device
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        return Handle(event=ev)

    def to_stage(self, stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]],
                 equal: EqualRuns | None = None) -> Handle:
        """One driver call for every run where the `cuda-bindings` package offers the batched copy
        (CUDA 12.8+), else one C++ loop of DMA copies: either way plain copy-engine transfers,
        none of them staged through pageable memory."""
        if not runs and (equal is None or not len(equal)):
            return DONE
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        stage.record_stream(self.h2d)  # freed early (a failed restore), it is not reused under the copy
        with torch.cuda.stream(self.h2d):
            return self._copy_runs(stage, runs, equal)

    def upload_runs(self, runs: Sequence[tuple[int, torch.Tensor]], nbytes: int) -> tuple[torch.Tensor, Handle]:
        """The buffer is the copy stream's memory, so the copy need not wait for the compute
        stream's queued kernels (memory they free is the compute stream's to reuse): a blend's
        reads go over while its recompute runs. The calling thread's stream (the default stream,
        which the engine computes on in every thread) is recorded on it, so it is reused only
        once the kernels that read it there have run."""
        if not runs:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device), DONE
        with torch.cuda.stream(self.h2d):
            stage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            handle = self._copy_runs(stage, runs, None)
        stage.record_stream(torch.cuda.current_stream(self.device))
        return stage, handle

    def _copy_runs(self, stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]],
                   equal: EqualRuns | None) -> Handle:
        """On the copy stream (entered by the caller): the runs into `stage`, one driver call where
        the batched copy is at hand, else one C++ loop of copies; an event after them."""
        if not _batched_copy(stage, runs, equal, self.h2d):
            every = all_runs(runs, equal)
            torch._foreach_copy_([stage[o:o + r.numel()] for o, r in every], [r for _, r in every], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.h2d)
        return Handle(event=ev)

    def stage(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        # Allocated on the compute stream, which reads them after waiting on the copy's event.
        out = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in src]
        return out, self.to_device(out, src)

    def to_host(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        out = [torch.empty(s.shape, dtype=s.dtype, pin_memory=self.pin) for s in src]
        if not src:
            return out, DONE
        handle = self._enqueue(self.d2h, out, src)
        for s in src:  # the device memory must outlive the copy even if the step frees it first
            s.record_stream(self.d2h)
        return out, handle

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        host = t.pin_memory() if self.pin else t
        return host.to(self.device, non_blocking=True)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def wait(self, handle: Handle) -> None:
        if handle.event is not None:
            torch.cuda.current_stream(self.device).wait_event(handle.event)

    def sync(self, handle: Handle) -> None:
        if handle.event is not None:
            handle.event.synchronize()

    def done(self, handle: Handle) -> bool:
        return handle.event is None or handle.event.query()

    def sync_compute(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def mark(self, copy: bool) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.h2d if copy else torch.cuda.current_stream(self.device))
        return ev


class LazyTransfer(Transfer):
    """A CPU back end that behaves like the worst legal asynchronous one: destinations hold NaN
    (or garbage for integers) until the copy is waited on, and the source is read only then (a
    source reused before the wait shows up as wrong data). For tests."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self._lock = threading.Lock()

    @property
    def is_async(self) -> bool:
        return True

    def _later(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        for d in dst:
            d.fill_(float("nan") if d.is_floating_point() else -1)
        return Handle(pending=list(zip(dst, src)))

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        return self._later(dst, src) if dst else DONE

    def to_stage(self, stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]],
                 equal: EqualRuns | None = None) -> Handle:
        runs = all_runs(runs, equal)
        return self._later([stage[o:o + r.numel()] for o, r in runs], [r for _, r in runs]) if runs else DONE

    def to_host(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        out = [torch.empty(s.shape, dtype=s.dtype) for s in src]
        return out, self._later(out, src)

    def wait(self, handle: Handle) -> None:
        with self._lock:
            pending, handle.pending = handle.pending, []
        with torch.inference_mode():  # destinations made during a step are inference tensors
            for d, s in pending:
                d.copy_(s)

    sync = wait

    def done(self, handle: Handle) -> bool:
        return not handle.pending


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's own bytes, as uint8."""
    lo = int(t.storage_offset()) * t.element_size()
    return storage_bytes(t)[lo:lo + t.numel() * t.element_size()]


_ALIGN = 512  # staging offsets stay aligned for every dtype view


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) bytes of its storage that a (strided) view reads."""
    size = t.element_size()
    lo = int(t.storage_offset()) * size  # int outside tracing; typed int | SymInt
    if not t.numel():
        return lo, lo
    return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size


def _spans(src: Sequence[torch.Tensor], align: int = 1) -> list[tuple[torch.Tensor, int, int, list[int]]]:
    """Sources grouped by the host buffer they view: (one of them, first byte, end byte, indices);
    the first byte rounded down to a multiple of `align`."""
    groups: dict[int, list] = {}
    for i, t in enumerate(src):
        lo, hi = byte_range(t)
        g = groups.get(t.untyped_storage().data_ptr())
        if g is None:
            groups[t.untyped_storage().data_ptr()] = [t, lo, hi, [i]]
        else:
            g[1], g[2] = min(g[1], lo), max(g[2], hi)
            g[3].append(i)
    return [(g[0], g[1] - g[1] % align, g[2], g[3]) for g in groups.values()]


_BATCH: list = []  # [the cuda-bindings driver module] once it worked, [None] once it did not


def _batched_copy(stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]], equal: EqualRuns | None,
                  stream: torch.cuda.Stream) -> bool:
    """The runs as one cuMemcpyBatchAsync call on `stream` (the driver walks the list: one host
    call however many runs). False where the package or the driver lacks it (then never tried
    again in this process); KVTIER_BATCHED_COPY=0 turns it off (to compare the two)."""
    if _BATCH == [None]:
        return False
    if not _BATCH and os.environ.get("KVTIER_BATCHED_COPY", "1") == "0":
        log.info("batched host-to-device copies turned off (KVTIER_BATCHED_COPY=0): one copy call per run")
        _BATCH[:] = [None]
        return False
    try:
        if not _BATCH:
            from cuda.bindings import driver
            _BATCH.append(driver)
        driver = _BATCH[0]
        base = stage.data_ptr()
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        dst, src, size = [base + o for o, _ in runs], [r.data_ptr() for _, r in runs], [r.numel() for _, r in runs]
        if equal is not None and len(equal):  # addresses by array arithmetic, not a view per run
            dst += (base + equal.dst).tolist()
            src += equal.addresses().tolist()
            size += [equal.nbytes] * len(equal)
        ptr = driver.CUdeviceptr
        out = driver.cuMemcpyBatchAsync([ptr(a) for a in dst], [ptr(a) for a in src], size, len(size), [attr], [0], 1,
                                        driver.CUstream(stream.cuda_stream))
        err = out[0] if isinstance(out, tuple) else out  # CUDA 12.8's binding also returns a failing index
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
        return True
    except Exception as e:  # ImportError, an old driver, a refused stream: plain copies serve
        # No cuda-bindings: expected. The driver refusing a call is worth seeing: from then on
        # every restore pays a copy call per run.
        (log.info if isinstance(e, ImportError) else log.warning)(
            "batched host-to-device copies unavailable (%s: %s): one copy call per run", type(e).__name__, e)
        _BATCH[:] = [None]
        return False


def _staged_spans(src: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor, int, int, list[int]]], int]:
    """The host buffers under views `src` as spans packed back to back in a stage: (its offset in the
    stage, one view of the buffer, first byte, end byte, the views' indices); the stage's bytes."""
    out, pos = [], 0
    for first, lo, hi, idx in _spans(src, align=16):
        out.append((pos, first, lo, hi, idx))
        pos += -(-(hi - lo) // _ALIGN) * _ALIGN
    return out, pos


def span_runs(src: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """`to_stage` runs moving the bytes under host views `src`: one run per host buffer (the span
    its views cover), packed back to back. -> (runs, staging bytes needed)."""
    spans, nbytes = _staged_spans(src)
    return [(pos, storage_bytes(first)[lo:hi]) for pos, first, lo, hi, _ in spans], nbytes


def packed_views(stage: torch.Tensor, src: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `stage` (uint8) that hold what the host views `src` read, once `span_runs(src)`'s
    runs are copied into it: each at its place in its buffer's span, shapes and strides kept."""
    out: list[torch.Tensor | None] = [None] * len(src)
    for pos, _, lo, _, idx in _staged_spans(src)[0]:
        for i in idx:
            t = src[i]
            base = stage.view(t.dtype)  # the stage's length and the span's start: multiples of any width
            at = pos + byte_range(t)[0] - lo  # bytes into the stage: a multiple of the view's width
            out[i] = base.as_strided(t.shape, t.stride(), base.storage_offset() + at // t.element_size())
    return cast("list[torch.Tensor]", out)


def _can_pin() -> bool:
    """Pinned host memory, unless the container refuses it (a low RLIMIT_MEMLOCK): then pageable
    memory, with one warning (copies are then staged by the driver, at a fraction of the speed)."""
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        return True
    except RuntimeError as e:
        log.warning("cannot pin host memory (%s); host<->device copies use pageable memory", e)
        return False


def make_transfer(device: torch.device) -> Transfer:
    return CudaTransfer(device) if device.type == "cuda" else Transfer(device)


@dataclass(frozen=True)
class Timeline:
    """Device times of a layer-wise restore from CUDA events: copies [copy_start, copy_end] on the
    copy stream, the new tokens' layers [compute_start, compute_end] on the compute stream."""

    copy_s: float
    compute_s: float
    span_s: float  # first start to last end

    @property
    def overlap(self) -> float:
        """Share of the shorter side hidden under the longer: 1 = fully overlapped, 0 = serial."""
        short = min(self.copy_s, self.compute_s)
        return 0.0 if short <= 0 else max(0.0, min(1.0, (self.copy_s + self.compute_s - self.span_s) / short))

    @staticmethod
    def of(copy_start, copy_end, compute_start, compute_end) -> "Timeline | None":
        if None in (copy_start, copy_end, compute_start, compute_end):
            return None
        compute_end.synchronize()
        copy_end.synchronize()
        first = copy_start if copy_start.elapsed_time(compute_start) >= 0 else compute_start
        last = copy_end if compute_end.elapsed_time(copy_end) >= 0 else compute_end
        return Timeline(copy_start.elapsed_time(copy_end) / 1e3, compute_start.elapsed_time(compute_end) / 1e3,
                        first.elapsed_time(last) / 1e3)
