"""Disk tier: chunk files in one or more directories, striped round-robin by chunk position.

Layout under each directory (`ns` is the store digest, so models never share files):
    {dir}/{ns}/c/{key[:2]}/{key}.kvc                               full chunks
    {dir}/{ns}/p/{parent[:2]}/{parent}[/{lead}]/{tokens:04d}-{key}.kvc  partial chunks, found by parent
    {dir}/{ns}/p/{parent[:2]}/{parent}[/{lead}]/{tokens:04d}-{key}.kvl  an empty mark: a full chunk's
                                                                   place under its parent
    {dir}/{ns}/tmp/                                                writes in flight
(`lead`: keys.lead_key, absent for chunks too short to have one).
A file is written under tmp/ and renamed into place, so a reader (in this or another process) sees
a whole chunk or none, and a writer killed mid-write leaves only a temp file, removed on the next
open. The in-memory index (key -> file, size) is rebuilt from the file names on open, so state and
the byte cap survive restarts; chunks written by other processes are adopted on first lookup. A
full chunk's mark is made after its file is in place and outlives it only until its parent is next
listed or the tier next opened (then it is removed): a mark without its chunk is never a read.

Reads use direct I/O (O_DIRECT) into page-aligned buffers where the filesystem allows it: the
device's DMA fills the caller's buffer while the CPU computes, instead of a page-cache copy on a
compute core (and a cold read is a device read, not a cache hit). Opening a restore's chunks reads
each one's header and first layer in one request (`head_bytes`); the restore's first layer group
is then copied from those bytes. A restore's reads of a later layer group that land straight in
their pool slots go to the kernel as one io_uring submission where the system has io_uring
(uring.py); other reads, and every read elsewhere, run on IO_DEPTH threads.

Stored KV can be inverted back to the prompt's text, so the tier's directories are created 0700 and
its files 0600 whatever the umask: only the server's user reads them. Paths are built only from
validated hex keys: a file name or a header from elsewhere never names a path outside the tier.
"""
from __future__ import annotations

import os
import stat
import tempfile
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar, cast

import torch

from ..format import FormatError, PackedChunk, Segment
from ..keys import Child, lead_of
from ..policy import EvictionPolicy
from ..staging import PAGE, aligned_empty
from ..throttle import Emulation
from ..validate import child_entry, first_layer_bytes, is_key
from . import uring
from .base import HEAD_BYTES, Expect, OpenChunk, PoolTarget, Reader, Segments, Tier, W, log

# Reads in flight at once: a device serves several requests faster than one at a time (queue
# depth), and the threads wait in the kernel without the GIL.
IO_DEPTH = 4
# The most of a chunk's first layer its opening reads with the header, and of all a restore's
# chunks together: a head stays in memory until the restore ends (128 chunks of llama3-8b's 64-token
# bf16 layer 0 are 32 MiB; beyond the total, as at 128K tokens, layer 0 goes through staging).
MAX_HEAD_AHEAD = 1 << 20
MAX_HEADS_AHEAD = 64 << 20
T = TypeVar("T")

SUFFIX = ".kvc"
MARK = ".kvl"
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def makedirs_private(path: str) -> None:
    """`os.makedirs` with every directory it creates 0700 (makedirs gives only the leaf its mode)."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        makedirs_private(parent)
    try:
        os.mkdir(path, PRIVATE_DIR)  # the umask only removes bits: 0700 stays 0700
    except FileExistsError:
        pass


def _child_of(name: str, lead: str) -> Child | None:
    """The child a partial chunk's file name or a full chunk's mark "{tokens:04d}-{key}" names
    (in the directory of `lead`), or None."""
    tok, dash, key = name[:-len(SUFFIX)].partition("-")
    return child_entry(tok, key, lead) if name.endswith((SUFFIX, MARK)) and dash else None


@dataclass(frozen=True)
class _File:
    dir: int  # index into the tier's directories
    path: str
    nbytes: int


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _pread_into(fd: int, dst: torch.Tensor, offset: int) -> int:
    """Fill uint8 `dst` from the file at `offset`; -> bytes read (short at the end of the file)."""
    view = dst.numpy().data
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


class _FileReader(Reader):
    def __init__(self, path: str, align: int) -> None:
        """`align`: the direct-I/O alignment of the file's device (0: buffered reads)."""
        self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if align else 0))
        self.direct = align > 0
        self.direct_align = align
        self.size = os.fstat(self.fd).st_size

    def scatter(self, offset: int, dests: Sequence[memoryview]) -> None:
        """Read the bytes at `offset` straight into consecutive `dests`: one syscall, the device's
        DMA does the copy (the caller checked direct I/O's alignment rules)."""
        want = sum(d.nbytes for d in dests)
        got = os.preadv(self.fd, dests, offset)
        if got != want:
            raise OSError(f"short direct read: {got} of {want} bytes")

    def span(self, offset: int, nbytes: int) -> int:
        if not self.direct:
            return nbytes
        return -(-(offset + nbytes) // PAGE) * PAGE - (offset - offset % PAGE)  # whole pages

    def read(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        nbytes = max(0, min(nbytes, self.size - offset))
        if not self.direct:
            dst = out[:nbytes] if out is not None else torch.empty(nbytes, dtype=torch.uint8)
            return dst[:_pread_into(self.fd, dst, offset)]
        # Direct I/O moves whole pages between page-aligned addresses: read the pages that cover
        # the range and return the view of the bytes asked for.
        start = offset - offset % PAGE
        span = self.span(offset, nbytes)
        dst = out[:span] if out is not None else aligned_empty(span)
        got = _pread_into(self.fd, dst, start)
        have = max(0, min(got - (offset - start), nbytes))
        return dst[offset - start:offset - start + have]

    def close(self) -> None:
        os.close(self.fd)


def direct_io_alignment(directory: str) -> int:
    """The alignment O_DIRECT reads need on the filesystem of `directory` (512 or 4096; 0 when it
    refuses direct I/O, as tmpfs and some overlays do)."""
    if not hasattr(os, "O_DIRECT"):
        return 0
    try:
        with tempfile.NamedTemporaryFile(dir=directory) as f:
            f.write(b"\0" * 2 * PAGE)
            f.flush()
            fd = os.open(f.name, os.O_RDONLY | os.O_DIRECT)
            try:
                buf = aligned_empty(2 * PAGE)
                for align in (512, PAGE):
                    try:
                        if os.preadv(fd, [buf[align:2 * align].numpy().data], align) == align:
                            return align
                    except OSError:
                        continue
                return 0
            finally:
                os.close(fd)
    except OSError:
        return 0


def head_bytes(expect: Expect) -> int:
    """What opening the chunk `expect` plans reads: its header and, where the layout is known and
    not large, its first layer too. A restore reads the first layer of every chunk before any
    compute can start; taken with the header, that is one request per chunk instead of two, and
    one wait fewer before the compute starts (`OpenChunk.read` serves it from the head)."""
    first = first_layer_bytes(expect)
    return HEAD_BYTES + (first if first <= MAX_HEAD_AHEAD else 0)


def _read_head(oc: OpenChunk, runs: list[list[Segment]], into: PoolTarget | None) -> tuple[Segments, int] | Exception:
    try:
        return oc.read(runs, None, into)
    except Exception as e:  # noqa: BLE001 - a bad segment is a miss (read_runs sorts out which kind)
        return e


def _in_batches(pool: ThreadPoolExecutor, fn: Callable[[int], T], n: int) -> list[T]:
    """fn(0..n-1) over IO_DEPTH workers, each taking a contiguous batch (one hand-off per worker,
    not per item: the items are many and small)."""
    step = -(-n // IO_DEPTH) if n else 1
    batches = pool.map(lambda a: [fn(i) for i in range(a, min(n, a + step))], range(0, n, step))
    return [x for b in batches for x in b]


class _Dir:
    def __init__(self, root: str, capacity: int, policy: EvictionPolicy) -> None:
        self.root = root
        self.capacity = capacity
        self.policy = policy
        self.used = 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(Tier):
    name = "disk"
    stages_reads = True

    def __init__(self, roots: list[str], capacities: list[int], ns: str | None,
                 make_policy: Callable[[], EvictionPolicy], emulation: Emulation = Emulation(),
                 fsync: bool = False) -> None:
        super().__init__(emulation)
        self.ns = ns  # None: admin mode over every namespace
        # The opening reads each chunk's first layer with its header (`head_bytes`). Off for a
        # store feeding a GPU: heads are pageable memory, the pinned staging serves copies better.
        self.read_ahead = True
        self.fsync = fsync
        self.dirs = [_Dir(os.path.abspath(r), c, make_policy()) for r, c in zip(roots, capacities)]
        self._files: dict[str, _File] = {}
        for i, d in enumerate(self.dirs):
            makedirs_private(d.root)
            if self.ns is not None:  # this namespace's directory is ours alone, whoever made it
                makedirs_private(self._ns_dir(i))
                os.chmod(self._ns_dir(i), PRIVATE_DIR)
            self._rebuild(i)
        aligns = [direct_io_alignment(d.root) for d in self.dirs]
        self.direct_align = 0 if 0 in aligns else max(aligns)
        self._io = ThreadPoolExecutor(max_workers=IO_DEPTH, thread_name_prefix="kvtier-disk-io")
        self._rings = uring.RingPool() if self.direct_align and uring.available() else None
        if not self.direct_align:
            log.info("disk tier: direct I/O is not available on %s; reading through the page cache",
                     ", ".join(d.root for d in self.dirs))
        for i in range(len(self.dirs)):  # a smaller cap than last time: trim to it now
            self._make_room(i, 0, frozenset())

    # --- paths and index ----------------------------------------------------------------------
    def _ns_dirs(self, i: int) -> list[str]:
        root = self.dirs[i].root
        if self.ns is not None:
            return [os.path.join(root, self.ns)]
        return [e.path for e in os.scandir(root) if e.is_dir()]

    def _ns_dir(self, i: int) -> str:
        assert self.ns is not None  # callers run only with a namespace (admin mode has none)
        return os.path.join(self.dirs[i].root, self.ns)

    def _full_path(self, i: int, key: str) -> str:
        return os.path.join(self._ns_dir(i), "c", key[:2], key + SUFFIX)

    def _partial_dir(self, i: int, parent: str, lead: str = "") -> str:
        return os.path.join(self._ns_dir(i), "p", parent[:2], parent, lead)  # (lead "": no trailing part)

    def _rebuild(self, i: int) -> None:
        found, marks = [], []
        for nsdir in self._ns_dirs(i):
            self._clean_tmp(os.path.join(nsdir, "tmp"))
            for base, _dirs, files in os.walk(nsdir):
                if os.path.basename(base) == "tmp":
                    continue
                for f in files:
                    if f.endswith(MARK):
                        marks.append(os.path.join(base, f))
                    if not f.endswith(SUFFIX):
                        continue
                    path = os.path.join(base, f)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    key = f[:-len(SUFFIX)].rsplit("-", 1)[-1]
                    if not is_key(key):
                        continue  # not a file this tier wrote
                    found.append((st.st_mtime_ns, key, path, st.st_size))
        found.sort()  # oldest first: approximates recency across the restart
        for _, key, path, size in found:
            self._index(key, _File(i, path, size))
        if self.ns is not None:  # marks whose chunk was evicted since they were listed last
            for path in marks:
                child = _child_of(os.path.basename(path), "")
                if child is not None and not self.contains(child.key):
                    _unlink(path)

    def _clean_tmp(self, tmpdir: str) -> None:
        try:
            names = os.listdir(tmpdir)
        except FileNotFoundError:
            return
        for n in names:
            parts = n.split(".")
            pid = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1
            if pid == os.getpid() or (pid > 0 and _pid_alive(pid)):
                continue  # a live writer (this process or another) still owns it
            try:
                os.unlink(os.path.join(tmpdir, n))
            except OSError:
                pass

    def _index(self, key: str, f: _File) -> None:
        old = self._files.get(key)
        if old is not None:
            self.dirs[old.dir].used -= old.nbytes
            self.dirs[old.dir].policy.remove(key)
        self._files[key] = f
        self.dirs[f.dir].used += f.nbytes
        self.dirs[f.dir].policy.insert(key, f.nbytes)

    def _adopt(self, key: str) -> _File | None:
        """A chunk another process wrote after our open: find it with one stat per directory."""
        if self.ns is None:
            return None
        for i in range(len(self.dirs)):
            path = self._full_path(i, key)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            except OSError as e:  # something else planted on the path (a file where a directory goes)
                self.refused("lookup", e)
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            f = _File(i, path, st.st_size)
            with self.lock:
                self._index(key, f)
            return f
        return None

    # --- Tier interface -----------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return key in self._files or self._adopt(key) is not None

    def children(self, parent: str, lead: str) -> list[Child]:
        if self.ns is None or not is_key(parent):  # admin mode: no namespace to look in (as the redis tier)
            return []
        out = []
        for i in range(len(self.dirs)):
            for lead_ in ("", lead) if lead else ("",):
                out += self._children_in(i, self._partial_dir(i, parent, lead_), lead_)
        return out

    def _children_in(self, i: int, pdir: str, lead: str) -> list[Child]:
        try:
            names = os.listdir(pdir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            self.refused("lookup", e)
            return []
        out = []
        for n in names:
            child = _child_of(n, lead)
            if child is None:
                continue  # not a file this tier wrote (or a lead's directory): skipped, never an error
            if n.endswith(MARK):  # a full chunk's mark: the chunk is its own file, maybe gone
                if not self.contains(child.key):
                    _unlink(os.path.join(pdir, n))
                    continue
            elif child.key not in self._files:
                try:
                    size = os.stat(os.path.join(pdir, n)).st_size
                except OSError:
                    continue
                with self.lock:
                    self._index(child.key, _File(i, os.path.join(pdir, n), size))
            out.append(child)
        return out

    def iterate(self) -> Iterator[str]:
        return iter(list(self._files))

    def touch(self, key: str) -> None:
        f = self._files.get(key)
        if f is not None:
            with self.lock:
                self.dirs[f.dir].policy.touch(key)

    def _open(self, key: str) -> Reader | None:
        f = self._files.get(key) or self._adopt(key)
        if f is None:
            return None
        try:
            return _FileReader(f.path, self.direct_align)
        except FileNotFoundError:  # removed by another process: forget it
            with self.lock:
                self._forget(key)
            return None

    def open_chunks(self, expects: Sequence[Expect]) -> list[OpenChunk | None]:
        """The I/O threads open the files and read their first pages (system calls: the GIL is
        free); then this thread parses and checks the headers. Parsing on the I/O threads as well
        made them queue behind each other for the GIL (64 chunks opened in 31 ms on four threads
        against 21 ms here), and parsing here while they still read was slower (26 ms). With
        io_uring, this thread opens the files and the first pages come in one submission."""
        keys = [e.key for e in expects]
        sizes = [head_bytes(e) for e in expects] if self.read_ahead else [HEAD_BYTES] * len(expects)
        if sum(sizes) - HEAD_BYTES * len(sizes) > MAX_HEADS_AHEAD:  # a very long context: as before
            sizes = [HEAD_BYTES] * len(expects)
        heads = self._open_heads_on_ring(keys, sizes) if self._rings is not None else \
            list(self._io.map(self._open_head, keys, sizes))
        return [self.open_chunk(e, opened=h) for e, h in zip(expects, heads)]

    def _open_heads_on_ring(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Reader | Exception | None]:
        assert self._rings is not None
        heads: list[Reader | Exception | None] = []
        jobs: list[uring.ReadJob] = []
        owners: list[tuple[int, int, torch.Tensor]] = []
        starts = [0]
        for size in sizes:  # each head a page-aligned slice of one buffer
            starts.append(starts[-1] + -(-size // PAGE) * PAGE)
        buf = aligned_empty(starts[-1])
        for i, (key, size) in enumerate(zip(keys, sizes)):
            try:
                reader = self._open(key)
            except Exception as e:  # noqa: BLE001 - open_chunk counts it as the miss it is
                heads.append(e)
                continue
            heads.append(reader)
            if isinstance(reader, _FileReader):
                n = min(reader.size, size)
                dst = buf[starts[i]:starts[i] + reader.span(0, n)]  # whole pages for direct I/O
                jobs.append(uring.ReadJob(reader.fd, 0, [dst.numpy().data]))
                owners.append((i, n, dst))
        for (i, n, dst), got in zip(owners, self._rings.read(jobs)):
            reader = cast(_FileReader, heads[i])
            if got < 0:
                reader.close()
                heads[i] = OSError(-got, os.strerror(-got))
            else:
                reader.head = dst[:min(got, n)]
        return heads

    def _open_head(self, key: str, size: int) -> Reader | Exception | None:
        reader = None
        try:
            reader = self._open(key)
            if reader is not None:
                reader.head = reader.read(0, min(reader.size, size))
            return reader
        except Exception as e:  # noqa: BLE001 - open_chunk counts it as the miss it is
            if reader is not None:
                reader.close()
            return e

    def read_runs(self, opened: Sequence[OpenChunk], runs: Sequence[list[list[Segment]]],
                  out: Sequence[torch.Tensor | None], into: Sequence[PoolTarget | None] | None = None) -> list[Segments] | None:
        targets = list(into or [None] * len(opened))
        results: list[tuple[Segments, int] | Exception | None] = [None] * len(opened)
        for i, (oc, chunk_runs) in enumerate(zip(opened, runs)):
            if chunk_runs and all(map(oc.in_head, chunk_runs)):  # read with the header: copied here
                results[i] = _read_head(oc, chunk_runs, targets[i])  # (not _try_read: no I/O thread)
        if self._rings is not None:
            self._read_on_ring(opened, runs, targets, results)
        rest = [i for i, r in enumerate(results) if r is None]  # what neither the heads nor the ring served

        def on_a_thread(j: int) -> tuple[Segments, int] | Exception:
            i = rest[j]
            return self._try_read(opened[i], runs[i], out[i], targets[i])

        for i, res in zip(rest, _in_batches(self._io, on_a_thread, len(rest))):
            results[i] = res
        return self._collect(opened, cast(list[tuple[Segments, int] | Exception], results))

    def _read_on_ring(self, opened: Sequence[OpenChunk], runs: Sequence[list[list[Segment]]],
                      into: Sequence[PoolTarget | None], results: list[tuple[Segments, int] | Exception | None]) -> None:
        """The chunks whose every run can go straight into its pool slots, read in one submission
        and verified there; their `results` filled in (the others are left None)."""
        assert self._rings is not None
        jobs: list[uring.ReadJob] = []
        placed: list[tuple[int, list[Segment], list[memoryview]]] = []
        for i, (oc, chunk_runs, target) in enumerate(zip(opened, runs, into)):
            if results[i] is not None or target is None or not isinstance(oc.reader, _FileReader):
                continue
            plan = [(run, oc.scatter_dests(run, target)) for run in chunk_runs]
            if not plan or any(d is None for _, d in plan):
                continue
            results[i] = ({}, 0)
            for run, dests in cast(list[tuple[list[Segment], list[memoryview]]], plan):
                jobs.append(uring.ReadJob(oc.reader.fd, run[0].offset, dests))
                placed.append((i, run, dests))
        if not jobs:  # every chunk was served with its header, or goes to the threads
            return
        for (i, run, dests), got in zip(placed, self._rings.read(jobs)):
            res = results[i]
            if isinstance(res, Exception):
                continue  # an earlier run of this chunk failed: it is a miss already
            want = sum(d.nbytes for d in dests)
            try:
                if got < 0:
                    raise OSError(-got, os.strerror(-got))
                if got != want:
                    raise OSError(f"short direct read: {got} of {want} bytes")
                opened[i].check_scattered(run, dests)
            except (OSError, FormatError) as e:
                results[i] = e
                continue
            assert res is not None
            results[i] = (res[0], res[1] + want)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._rings is not None:
            self._rings.close()

    def path_of(self, key: str) -> str | None:
        f = self._files.get(key)
        return None if f is None else f.path

    def put(self, packed: PackedChunk) -> bool:
        h = packed.header
        i = h.index % len(self.dirs)  # round-robin by position: a context spreads over all disks
        if self.ns is None:
            raise RuntimeError("admin-mode store cannot write chunks")
        if not (is_key(h.key) and is_key(h.parent)):  # the header may come from another tier
            self.counters["put_errors"] += 1
            return False
        if h.partial:
            path = os.path.join(self._partial_dir(i, h.parent, lead_of(h.prefix)), f"{h.tokens:04d}-{h.key}{SUFFIX}")
        else:
            path = self._full_path(i, h.key)
        with self.lock:
            if h.key in self._files:
                self.dirs[i].policy.touch(h.key)
                return True
            if packed.nbytes > self.dirs[i].capacity:
                return False
            if not self._make_room(i, packed.nbytes, frozenset({h.key})):
                return False
            # Reserve the bytes now so concurrent puts do not overshoot the cap.
            self._index(h.key, _File(i, path, packed.nbytes))
        try:
            self._write_atomic(i, path, packed)
        except OSError as e:
            log.warning("disk write of %s failed: %s", h.key, e)
            with self.lock:
                self._forget(h.key)
            self.counters["put_errors"] += 1
            return False
        if not h.partial:
            self._mark(os.path.join(self._partial_dir(i, h.parent, lead_of(h.prefix)), f"{h.tokens:04d}-{h.key}{MARK}"))
        self.counters["bytes_written"] += packed.nbytes
        self.counters["puts"] += 1
        return True

    def _mark(self, path: str) -> None:
        """A full chunk's place under its parent (for readers reusing it in part): an empty file."""
        try:
            makedirs_private(os.path.dirname(path))
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE))
        except OSError as e:  # the chunk is still found whole; only its reuse in part is lost
            self.refused("mark", e)

    def replace(self, packed: PackedChunk) -> bool:
        """The file renamed over (an open reader keeps the old inode)."""
        key = packed.header.key
        with self.lock:
            f = self._files.get(key)
        if f is None or packed.header.partial:
            return False
        try:
            self._write_atomic(f.dir, f.path, packed)
        except OSError as e:
            log.warning("disk rewrite of %s failed: %s", key, e)
            self.counters["put_errors"] += 1
            return False
        with self.lock:
            if key in self._files:
                self._index(key, _File(f.dir, f.path, packed.nbytes))
        self.counters["bytes_written"] += packed.nbytes
        return True

    def _write_atomic(self, i: int, path: str, packed: PackedChunk) -> None:
        tmpdir = os.path.join(self._ns_dir(i), "tmp")
        makedirs_private(tmpdir)
        makedirs_private(os.path.dirname(path))
        tmp = os.path.join(tmpdir, f"{packed.header.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
            with os.fdopen(fd, "wb") as fh:
                for b in packed.buffers:
                    fh.write(b)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
            if self.fsync:
                dfd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _make_room(self, i: int, n: int, protected: frozenset[str]) -> bool:
        d = self.dirs[i]
        return self._evict_for(d.policy, lambda: d.used, d.capacity, n, protected)

    def wrap_policies(self, wrap: Callable[[EvictionPolicy], W]) -> list[W]:
        out = []
        for d in self.dirs:
            wrapped = wrap(d.policy)
            d.policy = wrapped
            out.append(wrapped)
        return out

    def size_of(self, key: str) -> int | None:
        f = self._files.get(key)
        return None if f is None else f.nbytes

    def _forget(self, key: str) -> _File | None:
        f = self._files.pop(key, None)
        if f is not None:
            self.dirs[f.dir].used -= f.nbytes
            self.dirs[f.dir].policy.remove(key)
        return f

    def delete(self, key: str) -> None:
        with self.lock:
            f = self._forget(key)
        if f is None:
            return
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass
        except OSError as e:  # a directory planted where the file was, a read-only disk: left, counted
            self.refused("delete", e)
        for d in (os.path.dirname(f.path), os.path.dirname(os.path.dirname(f.path))):
            try:
                os.rmdir(d)  # empty partial dirs (a lead's, then its parent's) would otherwise pile up
            except OSError:
                break

    def clear(self) -> int:
        n = 0
        for key in list(self._files):
            self.delete(key)
            n += 1
        for i in range(len(self.dirs)):
            for nsdir in self._ns_dirs(i):
                self._clean_tmp(os.path.join(nsdir, "tmp"))
                for base, _dirs, files in os.walk(os.path.join(nsdir, "p"), topdown=False):
                    for f in files:
                        if f.endswith(MARK):
                            _unlink(os.path.join(base, f))
                    try:
                        os.rmdir(base)  # (only if empty)
                    except OSError:
                        pass
        return n

    def usage(self) -> dict:
        return dict(entries=len(self._files), bytes_used=sum(d.used for d in self.dirs),
                    capacity=sum(d.capacity for d in self.dirs),
                    directories=[d.root for d in self.dirs], io_uring=self._rings is not None)
