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

Whoever can write to a directory of the tier can put a symbolic link where a directory or file of
the tier goes. The tier never follows one (safe_paths.py): every operation below a root goes
through directory handles opened one component at a time with O_NOFOLLOW, so a link costs a miss
or an unwritten chunk, counted (`links`, and `errors`: store_errors in /metrics) and logged once
per kind, and no file outside the root is ever read, written, created or deleted. The root itself
is the operator's and may be a link (a store directory on another disk): it is resolved once, at
open, and only what lies below it is treated as hostile.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, TypeVar, cast

import torch

from ..format import FormatError, PackedChunk, Segment
from ..keys import Child, lead_of
from ..policy import EvictionPolicy
from ..safe_paths import DirTree, LinkFound, Listing, fd_budget, lstat, makedirs_private, open_file, walk
from ..staging import PAGE, aligned_empty
from ..throttle import Emulation
from ..validate import LEAD, child_entry, first_layer_bytes, is_key
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
# The names `_write_atomic` gives its temp files, "{key}.{pid}.{8 hex}.tmp": cleanup removes only
# these (and only regular files), whatever else is in the directory.
TMP_NAME = re.compile(r"[0-9a-f]{32}\.([0-9]+)\.[0-9a-f]{8}\.tmp")
Rel = tuple[str, ...]  # a directory below a root: (ns, "c", shard), (ns, "p", shard, parent[, lead]), ...
# What a link found where the tier was about to work costs, by the kind of work (one log line each).
LINK_EFFECTS = {
    "read": "the chunk is a miss",
    "lookup": "the chunk is a miss",
    "write": "the chunk is not written",
    "mark": "the chunk is stored but not found by readers reusing it in part",
    "delete": "nothing through it is removed",
    "clean": "no temp file through it is removed",
    "index": "nothing through it is indexed",
    "clear": "nothing through it is removed",
    "namespace": "this namespace is not stored in that directory",
}


def _child_of(name: str, lead: str) -> Child | None:
    """The child a partial chunk's file name or a full chunk's mark "{tokens:04d}-{key}" names
    (in the directory of `lead`), or None."""
    tok, dash, key = name[:-len(SUFFIX)].partition("-")
    return child_entry(tok, key, lead) if name.endswith((SUFFIX, MARK)) and dash else None


@dataclass(frozen=True)
class _File:
    dir: int  # index into the tier's directories
    rel: Rel  # the file's directory below that root
    name: str
    nbytes: int


class _Located(str):
    """A chunk file's path as text (messages, `path_of`) that opens the file through the tier's
    directory handles, never through a link: `opener(flags)` -> a file descriptor."""

    opener: Callable[[int], int] | None = None


def _full_at(ns: str, key: str) -> tuple[Rel, str]:
    return (ns, "c", key[:2]), key + SUFFIX


def _partial_rel(ns: str, parent: str, lead: str = "") -> Rel:
    return (ns, "p", parent[:2], parent) + ((lead,) if lead else ())  # (lead "": no trailing part)


def _stale_tmp(e: os.DirEntry) -> bool:
    """`e` is a temp file this tier wrote (its exact name pattern, a regular file) whose writer is gone."""
    m = TMP_NAME.fullmatch(e.name)
    if m is None or not e.is_file(follow_symlinks=False):
        return False
    pid = int(m[1])
    return pid != os.getpid() and not (pid > 0 and _pid_alive(pid))  # a live writer still owns it


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
        """`align`: the direct-I/O alignment of the file's device (0: buffered reads). A `_Located`
        path is opened through the tier's handles; any other never through a final link."""
        flags = os.O_RDONLY | (os.O_DIRECT if align else 0)
        opener = getattr(path, "opener", None)
        self.fd = opener(flags) if opener is not None else os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):  # a directory or a FIFO planted in the file's place
                raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL, "not a regular file", path)
        except BaseException:
            os.close(self.fd)
            raise
        self.direct = align > 0
        self.direct_align = align
        self.size = st.st_size

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
    def __init__(self, root: str, capacity: int, policy: EvictionPolicy, handles: int) -> None:
        # The operator's root is trusted, a link included (resolved once here: DirTree); what lies
        # below it is not.
        makedirs_private(os.path.realpath(root))
        self.tree = DirTree(root, handles)
        self.root = self.tree.root
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
    local_reads = True

    def __init__(self, roots: list[str], capacities: list[int], ns: str | None,
                 make_policy: Callable[[], EvictionPolicy], emulation: Emulation = Emulation(),
                 fsync: bool = False) -> None:
        super().__init__(emulation)
        self.counters["links"] = 0  # symbolic links met below a root (each also one of `errors`)
        self.ns = ns  # None: admin mode over every namespace
        # The opening reads each chunk's first layer with its header (`head_bytes`). Off for a
        # store feeding a GPU: heads are pageable memory, the pinned staging serves copies better.
        self.read_ahead = True
        self.fsync = fsync
        handles = max(8, fd_budget() // max(1, len(roots)))
        self.dirs = [_Dir(r, c, make_policy(), handles) for r, c in zip(roots, capacities)]
        self._files: dict[str, _File] = {}
        self._shards: dict[Rel, Rel] = {}  # one tuple per shard directory, shared by its files' entries
        for i in range(len(self.dirs)):
            if self.ns is not None:
                self._claim_ns(i)
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
    def _claim_ns(self, i: int) -> None:
        """This namespace's directory is ours alone, whoever made it: 0700, set on its handle (a
        link there is never followed, so never chmodded)."""
        assert self.ns is not None
        try:
            with self.dirs[i].tree.opened((self.ns,), create=True, mode=PRIVATE_DIR) as fd:
                os.fchmod(fd, PRIVATE_DIR)
        except LinkFound as e:
            self._found_link("namespace", e)
        except OSError as e:  # (a file planted there): every operation on it is then a counted miss
            self.refused("namespace", e)

    def _found_link(self, what: str, err: LinkFound) -> None:
        """A link where the tier was about to work: not followed, counted, logged once per kind."""
        self.counters["links"] += 1
        self.counters["errors"] += 1
        if f"link:{what}" not in self._logged:
            self._logged.add(f"link:{what}")
            log.warning("disk tier: %s is a symbolic link; it was not followed, %s (logged once per kind of "
                        "operation; each one counts in the disk tier's links and errors)",
                        err.filename, LINK_EFFECTS.get(what, "the operation is skipped"))

    def _shard(self, rel: Rel) -> Rel:
        return self._shards.setdefault(rel, rel)

    def _path(self, f: _File) -> str:
        return self.dirs[f.dir].tree.shown(f.rel, f.name)

    def _in_dir(self, i: int, rel: Rel, fn: Callable[[int], T], create: bool = False) -> T:
        """`fn(handle of directory rel)` below root i (made if `create`). Where a kept handle's
        directory was removed meanwhile (another process's clear), once more on a fresh one.
        Raises LinkFound where a component of `rel` is a link, and what `fn` raises."""
        tree = self.dirs[i].tree
        for attempt in (0, 1):
            try:
                with tree.opened(rel, create, PRIVATE_DIR) as fd:
                    return fn(fd)
            except FileNotFoundError:
                if attempt or not tree.forget_removed(rel):
                    raise
        raise AssertionError("unreachable")

    def _ns_names(self, i: int) -> list[str]:
        if self.ns is not None:
            return [self.ns]
        tree, out = self.dirs[i].tree, []
        with tree.fresh(()) as fd, os.scandir(fd) as it:
            for e in it:
                if e.is_symlink():
                    self._found_link("index", LinkFound(tree.shown((e.name,))))
                elif e.is_dir(follow_symlinks=False):
                    out.append(e.name)
        return out

    def _walk(self, i: int, rel: Rel, what: str) -> Iterator[Listing]:
        """Every directory below `rel` (deepest first), links counted and never followed."""
        tree = self.dirs[i].tree
        try:
            with tree.fresh(rel) as fd:
                for listing in walk(fd, rel, tree.shown(rel)):
                    for name in listing.links:
                        self._found_link(what, LinkFound(tree.shown(listing.rel, name)))
                    yield listing
        except FileNotFoundError:
            return
        except LinkFound as e:
            self._found_link(what, e)
        except OSError as e:
            self.refused(what, e)

    def _rebuild(self, i: int) -> None:
        found, marks = [], []
        for ns in self._ns_names(i):
            self._clean_tmp(i, ns)
            for top in ("c", "p"):  # (the only directories the tier writes chunks and marks in)
                for listing in self._walk(i, (ns, top), "index"):
                    for e in listing.files:
                        if e.name.endswith(MARK):
                            marks.append((listing.rel, e.name))
                        key = e.name[:-len(SUFFIX)].rsplit("-", 1)[-1]
                        if not e.name.endswith(SUFFIX) or not is_key(key):
                            continue  # not a file this tier wrote
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        rel = self._shard(listing.rel) if len(listing.rel) == 3 else listing.rel
                        found.append((st.st_mtime_ns, key, rel, e.name, st.st_size))
        found.sort()  # oldest first: approximates recency across the restart
        for _, key, rel, name, size in found:
            self._index(key, _File(i, rel, name, size))
        if self.ns is not None:  # marks whose chunk was evicted since they were listed last
            for rel, name in marks:
                child = _child_of(name, "")
                if child is not None and not self.contains(child.key):
                    self._unlink_quietly(i, rel, name)

    def _unlink_quietly(self, i: int, rel: Rel, name: str) -> None:
        try:
            self._in_dir(i, rel, lambda fd: os.unlink(name, dir_fd=fd))
        except OSError:
            pass

    def _clean_tmp(self, i: int, ns: str) -> None:
        """Remove the temp files of writers that are gone: only names this tier gives them, only
        regular files, only in the tmp directory itself (never through a link)."""
        tree = self.dirs[i].tree
        try:
            with tree.fresh((ns, "tmp")) as fd, os.scandir(fd) as it:
                for e in it:
                    if e.is_symlink():
                        self._found_link("clean", LinkFound(tree.shown((ns, "tmp"), e.name)))
                    elif _stale_tmp(e):
                        try:
                            os.unlink(e.name, dir_fd=fd)
                        except OSError:
                            pass
        except FileNotFoundError:
            return
        except LinkFound as e:
            self._found_link("clean", e)
        except OSError as e:
            self.refused("clean", e)

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
        rel, name = _full_at(self.ns, key)
        for i in range(len(self.dirs)):
            shown = self.dirs[i].tree.shown(rel, name)
            try:
                st = self._in_dir(i, rel, lambda fd: lstat(name, fd, shown))
            except FileNotFoundError:
                continue
            except LinkFound as e:
                self._found_link("lookup", e)
                continue
            except OSError as e:  # something else planted on the path (a file where a directory goes)
                self.refused("lookup", e)
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            f = _File(i, self._shard(rel), name, st.st_size)
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
                out += self._children_in(i, _partial_rel(self.ns, parent, lead_), lead_)
        return out

    def _children_in(self, i: int, rel: Rel, lead: str) -> list[Child]:
        try:
            return self._in_dir(i, rel, lambda fd: self._children_at(i, rel, fd, lead))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except LinkFound as e:
            self._found_link("lookup", e)
            return []
        except OSError as e:
            self.refused("lookup", e)
            return []

    def _children_at(self, i: int, rel: Rel, fd: int, lead: str) -> list[Child]:
        """The children listed in the partial directory `rel`, open as `fd` (deeper than the kept
        handles: the caller's own, so listing it moves no shared position)."""
        out = []
        with os.scandir(fd) as it:
            for e in it:
                child = _child_of(e.name, lead)
                if child is None:
                    continue  # not a file this tier wrote (or a lead's directory): skipped, never an error
                if e.is_symlink():
                    self._found_link("lookup", LinkFound(self.dirs[i].tree.shown(rel, e.name)))
                    continue
                if e.name.endswith(MARK):  # a full chunk's mark: the chunk is its own file, maybe gone
                    if not self.contains(child.key):
                        try:
                            os.unlink(e.name, dir_fd=fd)
                        except OSError:
                            pass
                        continue
                elif child.key not in self._files:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    with self.lock:
                        self._index(child.key, _File(i, rel, e.name, st.st_size))
                out.append(child)
        return out

    def iterate(self) -> Iterator[str]:
        return iter(list(self._files))

    def touch(self, key: str) -> None:
        f = self._files.get(key)
        if f is not None:
            with self.lock:
                self.dirs[f.dir].policy.touch(key)

    def _located(self, f: _File) -> _Located:
        shown = self._path(f)
        path = _Located(shown)
        path.opener = partial(self._open_file, f, shown)  # (not `path` itself: no cycle to leave to the collector)
        return path

    def _open_file(self, f: _File, shown: str, flags: int) -> int:
        return self._in_dir(f.dir, f.rel, lambda fd: open_file(f.name, flags, fd, shown))

    def _open(self, key: str) -> Reader | None:
        f = self._files.get(key) or self._adopt(key)
        if f is None:
            return None
        try:
            return _FileReader(self._located(f), self.direct_align)
        except (FileNotFoundError, LinkFound) as e:  # removed by another process, or a link: forget it
            if isinstance(e, LinkFound):
                self._found_link("read", e)
            with self.lock:
                if self._files.get(key) is f:
                    self._forget(key)
            return None

    def open_chunks(self, expects: Sequence[Expect]) -> list[OpenChunk | None]:
        """The I/O threads open the files and read their first pages (system calls: the GIL is
        free); then this thread parses and checks the headers. Parsing on the I/O threads as well
        made them queue behind each other for the GIL, and parsing here while they still read was
        slower too (both measured slower than this; scripts/profile_disk_restore.py shows it). With
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
        for d in self.dirs:
            d.tree.close()

    def path_of(self, key: str) -> str | None:
        f = self._files.get(key)
        return None if f is None else self._path(f)

    def put(self, packed: PackedChunk) -> bool:
        h = packed.header
        i = h.index % len(self.dirs)  # round-robin by position: a context spreads over all disks
        if self.ns is None:
            raise RuntimeError("admin-mode store cannot write chunks")
        lead = lead_of(h.prefix)
        if not (is_key(h.key) and is_key(h.parent) and (not lead or LEAD.match(lead))):  # the header may come from another tier
            self.counters["put_errors"] += 1
            return False
        if h.partial:
            rel, name = _partial_rel(self.ns, h.parent, lead), f"{h.tokens:04d}-{h.key}{SUFFIX}"
        else:
            rel, name = _full_at(self.ns, h.key)
            rel = self._shard(rel)
        with self.lock:
            if h.key in self._files:
                self.dirs[i].policy.touch(h.key)
                return True
            if packed.nbytes > self.dirs[i].capacity:
                return False
            if not self._make_room(i, packed.nbytes, frozenset({h.key})):
                return False
            # Reserve the bytes now so concurrent puts do not overshoot the cap.
            self._index(h.key, _File(i, rel, name, packed.nbytes))
        try:
            self._write_atomic(i, rel, name, packed)
        except OSError as e:
            if isinstance(e, LinkFound):
                self._found_link("write", e)
            else:
                log.warning("disk write of %s failed: %s", h.key, e)
            with self.lock:
                self._forget(h.key)
            self.counters["put_errors"] += 1
            return False
        if not h.partial:
            self._mark(i, _partial_rel(self.ns, h.parent, lead), f"{h.tokens:04d}-{h.key}{MARK}")
        self.counters["bytes_written"] += packed.nbytes
        self.counters["puts"] += 1
        return True

    def _mark(self, i: int, rel: Rel, name: str) -> None:
        """A full chunk's place under its parent (for readers reusing it in part): an empty file."""
        shown = self.dirs[i].tree.shown(rel, name)
        try:
            self._in_dir(i, rel, lambda fd: os.close(open_file(name, os.O_WRONLY | os.O_CREAT, fd, shown, PRIVATE_FILE)),
                         create=True)
        except LinkFound as e:  # the chunk is still found whole; only its reuse in part is lost
            self._found_link("mark", e)
        except OSError as e:
            self.refused("mark", e)

    def replace(self, packed: PackedChunk) -> bool:
        """The file renamed over (an open reader keeps the old inode)."""
        key = packed.header.key
        with self.lock:
            f = self._files.get(key)
        if f is None or packed.header.partial:
            return False
        try:
            self._write_atomic(f.dir, f.rel, f.name, packed)
        except OSError as e:
            if isinstance(e, LinkFound):
                self._found_link("write", e)
            else:
                log.warning("disk rewrite of %s failed: %s", key, e)
            self.counters["put_errors"] += 1
            return False
        with self.lock:
            if key in self._files:
                self._index(key, _File(f.dir, f.rel, f.name, packed.nbytes))
        self.counters["bytes_written"] += packed.nbytes
        return True

    def _write_atomic(self, i: int, rel: Rel, name: str, packed: PackedChunk) -> None:
        """Write `packed` under the namespace's tmp directory, then rename it to `name` in `rel`
        (both directories made if missing): readers see the old file, the new one, or none. Raises
        OSError (LinkFound where a directory on the way is a link)."""
        tmp = f"{packed.header.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # (TMP_NAME)

        def into(tmp_fd: int) -> None:
            self._in_dir(i, rel, lambda dst_fd: self._write_into(tmp_fd, tmp, dst_fd, name, packed), create=True)

        self._in_dir(i, (rel[0], "tmp"), into, create=True)

    def _write_into(self, tmp_fd: int, tmp: str, dst_fd: int, name: str, packed: PackedChunk) -> None:
        # O_EXCL with O_NOFOLLOW: a fresh file of our own, never an existing name or a link's target.
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, tmp_fd, tmp, PRIVATE_FILE)
        try:
            with os.fdopen(fd, "wb") as fh:
                for b in packed.buffers:
                    fh.write(b)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            # A rename replaces the name itself: a link at `name` is replaced, never followed.
            os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=dst_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=tmp_fd)
            except OSError:
                pass
            raise
        if self.fsync:
            os.fsync(dst_fd)

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
            self._in_dir(f.dir, f.rel, lambda fd: os.unlink(f.name, dir_fd=fd))  # (a link there: the link itself goes)
        except FileNotFoundError:
            pass
        except LinkFound as e:
            self._found_link("delete", e)
        except OSError as e:  # a directory planted where the file was, a read-only disk: left, counted
            self.refused("delete", e)
        self._prune(f.dir, f.rel)

    def _prune(self, i: int, rel: Rel) -> None:
        """Remove the partial directories of `rel` left empty (a lead's, then its parent's), which
        would otherwise pile up; shard directories stay (their handles are kept)."""
        while len(rel) > 3 and rel[1] == "p":
            name, rel = rel[-1], rel[:-1]
            try:
                self._in_dir(i, rel, lambda fd: os.rmdir(name, dir_fd=fd))  # (only if empty; never a link)
            except OSError:
                break

    def clear(self) -> int:
        n = 0
        for key in list(self._files):
            self.delete(key)
            n += 1
        for i in range(len(self.dirs)):
            for ns in self._ns_names(i):
                self._clean_tmp(i, ns)
                self._clear_marks(i, ns)
        return n

    def _clear_marks(self, i: int, ns: str) -> None:
        """Remove the marks (regular files only) and the emptied parents' and leads' directories
        under the namespace's partial index; links are counted and left, never followed."""
        for listing in self._walk(i, (ns, "p"), "clear"):  # deepest first: a directory is emptied before its parent
            for e in listing.files:
                if e.name.endswith(MARK):
                    try:
                        os.unlink(e.name, dir_fd=listing.fd)
                    except OSError:
                        pass
            if len(listing.rel) < 3:
                continue  # (its subdirectories are shards: kept)
            for name in listing.dirs:
                try:
                    os.rmdir(name, dir_fd=listing.fd)  # (only if empty)
                except OSError:
                    pass

    def usage(self) -> dict:
        return dict(entries=len(self._files), bytes_used=sum(d.used for d in self.dirs),
                    capacity=sum(d.capacity for d in self.dirs),
                    directories=[d.root for d in self.dirs], io_uring=self._rings is not None)
