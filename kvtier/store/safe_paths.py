"""File operations below a trusted directory that never follow a symbolic link.

Whoever can write to a tier's directory can put a link where one of the tier's directories or
files goes, pointing anywhere the server's user can reach. Following it would let that writer
steer the server: delete files elsewhere, write users' state elsewhere, create files elsewhere.
So every operation below the root works on directory handles (file descriptors), opened one path
component at a time with O_NOFOLLOW relative to the handle above, and names only a plain entry of
its own directory: no component is ever resolved by the kernel through a link.

`DirTree` keeps the shallow handles of one root open (the namespace's directories and their
shards, the directories nearly every read and write passes through), up to a budget of descriptors.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Files are opened without following a link, and without blocking on a FIFO planted in their place.
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class LinkFound(OSError):
    """A symbolic link where a directory or file of the tier goes: it was not followed."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ELOOP, "a symbolic link, not followed", path)


def makedirs_private(path: str) -> None:
    """`os.makedirs` with every directory it creates 0700 (makedirs gives only the leaf its mode).
    For a root the operator named only: below a root, directories are made through handles."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        makedirs_private(parent)
    try:
        os.mkdir(path, 0o700)  # the umask only removes bits: 0700 stays 0700
    except FileExistsError:
        pass


def check_name(name: str) -> str:
    """`name` if it names an entry of a directory (no separator, not "." or ".."), else ValueError."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a plain file name: {name!r}")
    return name


def is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_dir(name: str, dir_fd: int, shown: str, create: bool = False, mode: int = 0o700) -> int:
    """A handle of directory `name` in `dir_fd`, made (`mode`) first if missing and `create`.
    Raises LinkFound (naming `shown`) where `name` is a link, and the OSError of anything else that
    is not a directory there (a file: NotADirectoryError; missing: FileNotFoundError)."""
    check_name(name)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and is_link(name, dir_fd):
            raise LinkFound(shown) from None
        raise
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)  # never through a link: mkdir fails on any existing name
    except FileExistsError:
        pass  # made meanwhile by another writer (or a link planted meanwhile: the open below says)
    return open_dir(name, dir_fd, shown)


def open_file(name: str, flags: int, dir_fd: int, shown: str, mode: int = 0o600) -> int:
    """`os.open` of `name` in `dir_fd` that never follows a link (LinkFound, naming `shown`)."""
    check_name(name)
    try:
        return os.open(name, flags | FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and flags & os.O_EXCL and is_link(name, dir_fd)):
            raise LinkFound(shown) from None
        raise


def lstat(name: str, dir_fd: int, shown: str) -> os.stat_result:
    """The entry `name` of `dir_fd` itself; LinkFound where it is a link."""
    st = os.stat(check_name(name), dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        raise LinkFound(shown)
    return st


@dataclass
class Listing:
    """One directory met by `walk`: its entries by kind (other kinds, as FIFOs, are left out)."""

    rel: tuple[str, ...]
    fd: int  # valid only while the walk is at this directory
    files: list[os.DirEntry] = field(default_factory=list)  # regular files
    dirs: list[str] = field(default_factory=list)  # directories (each walked too)
    links: list[str] = field(default_factory=list)  # symbolic links: never followed


def _list(fd: int, rel: tuple[str, ...]) -> Listing:
    out = Listing(rel, fd)
    with os.scandir(fd) as it:
        for e in it:
            if e.is_symlink():
                out.links.append(e.name)
            elif e.is_dir(follow_symlinks=False):
                out.dirs.append(e.name)
            elif e.is_file(follow_symlinks=False):
                out.files.append(e)
    return out


def walk(fd: int, rel: tuple[str, ...], shown: str) -> Iterator[Listing]:
    """Every directory below `fd` (itself included), deepest first, never through a link: a
    directory swapped for a link while the walk runs shows up in its parent's `links`. One handle
    per level is open at a time. A directory that cannot be read (gone meanwhile, no permission)
    is left out."""
    try:
        here = _list(fd, rel)
    except OSError:
        return
    walked = []
    for name in here.dirs:
        try:
            sub = open_dir(name, fd, os.path.join(shown, name))
        except LinkFound:
            here.links.append(name)
            continue
        except OSError:
            continue
        try:
            yield from walk(sub, rel + (name,), os.path.join(shown, name))
        finally:
            os.close(sub)
        walked.append(name)
    here.dirs = walked
    yield here


def fd_budget() -> int:
    """How many directory handles a process may keep open for its disk tiers: a share of its
    descriptor limit (a soft limit of 1024 is common), so the rest of the server never runs short."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


class DirTree:
    """Handles of the directories below one root, opened without following links. Handles at most
    `keep_depth` components deep are kept open (up to `budget` of them); deeper ones are opened from
    the deepest kept one for one operation and closed after it. A kept handle whose directory went
    away is dropped, and closed once no operation uses it (its number is never reused under one).

    The root itself is given by the operator and trusted: it is resolved once (`os.path.realpath`,
    so a root that is a link to another disk works as the operator meant) and opened; only what lies
    below it is treated as hostile."""

    def __init__(self, root: str, budget: int, keep_depth: int = 3) -> None:
        self.root = os.path.realpath(root)
        self.fd = os.open(self.root, DIR_FLAGS)
        self.budget = budget
        self.keep_depth = keep_depth
        self._kept: dict[tuple[str, ...], int] = {}
        self._uses: dict[int, int] = {}  # kept (or dropped) handle -> operations using it now
        self._dropped: set[int] = set()  # dropped handles still in use: closed by their last user
        self._old_roots: list[int] = []  # roots made again after a removal: closed with the tree
        self._lock = threading.Lock()
        self._closed = False

    def shown(self, rel: tuple[str, ...], name: str = "") -> str:
        """The path of `rel` (and `name` in it), for messages."""
        return os.path.join(self.root, *rel, *((name,) if name else ()))

    @contextmanager
    def opened(self, rel: tuple[str, ...], create: bool = False, mode: int = 0o700) -> Iterator[int]:
        """A handle of the directory `rel` below the root, each missing component made (`mode`) if
        `create`. Raises LinkFound where any component is a link, and OSError otherwise."""
        fd, owned = self._open(rel, create, mode)
        try:
            yield fd
        finally:
            self._let_go(fd, owned)

    @contextmanager
    def fresh(self, rel: tuple[str, ...]) -> Iterator[int]:
        """A handle of `rel` of the caller's own, for listing it: a listing moves its handle's
        position, and a kept handle is shared between threads."""
        with self.opened(rel) as fd:
            own = os.open(".", DIR_FLAGS, dir_fd=fd)  # the directory itself: no name to resolve
        try:
            yield own
        finally:
            os.close(own)

    def _open(self, rel: tuple[str, ...], create: bool, mode: int) -> tuple[int, bool]:
        """-> (handle, whether it is the caller's own to close; else a kept one, in use until
        `_let_go`)."""
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the disk tier is closed")
            depth, fd = 0, self.fd
            for n in range(min(len(rel), self.keep_depth), 0, -1):  # the deepest kept handle
                kept = self._kept.get(rel[:n])
                if kept is not None:
                    depth, fd = n, kept
                    self._uses[fd] += 1
                    break
        owned = False
        try:
            while depth < len(rel):
                sub = open_dir(rel[depth], fd, self.shown(rel[:depth + 1]), create, mode)
                self._let_go(fd, owned)
                depth += 1
                fd, owned = sub, not self._keep(rel[:depth], sub)
        except BaseException:
            self._let_go(fd, owned)
            raise
        return fd, owned

    def _keep(self, rel: tuple[str, ...], fd: int) -> bool:
        """Keep `fd` (in use by the caller) as the handle of `rel` if it is shallow and the budget
        allows."""
        if len(rel) > self.keep_depth:
            return False
        with self._lock:
            if self._closed or rel in self._kept or len(self._kept) + len(self._dropped) >= self.budget:
                return False
            self._kept[rel] = fd
            self._uses[fd] = 1
            return True

    def _let_go(self, fd: int, owned: bool) -> None:
        """The caller is done with `fd`: its own is closed; a kept one is released (and closed if
        it was dropped meanwhile and this was its last user)."""
        if owned:
            os.close(fd)
            return
        if fd == self.fd:
            return
        with self._lock:
            if self._closed:
                return  # (closed with the tree)
            self._uses[fd] -= 1
            if self._uses[fd] or fd not in self._dropped:
                return
            del self._uses[fd]
            self._dropped.discard(fd)
        os.close(fd)

    def forget_removed(self, rel: tuple[str, ...]) -> bool:
        """Drop the kept handles on the way to `rel` whose directory is no longer there under its
        name (removed by another process or a clear, or replaced): the next use opens (or makes)
        it anew, through the same checks. The root removed too is made again. -> whether any was
        dropped."""
        idle: list[int] = []
        with self._lock:
            if not self._root_still_there():
                return self._make_root_again()
            gone = None
            for n in range(min(len(rel), self.keep_depth), 0, -1):  # from the deepest: a directory
                fd = self._kept.get(rel[:n])                         # goes only once emptied
                if fd is None:
                    continue
                if self._still_there(fd, rel[:n]):
                    break
                gone = rel[:n]
            if gone is None:
                return False
            for r in [r for r in self._kept if r[:len(gone)] == gone]:  # it and the handles below it
                fd = self._kept.pop(r)
                if self._uses[fd]:
                    self._dropped.add(fd)
                else:
                    del self._uses[fd]
                    idle.append(fd)
        for fd in idle:
            os.close(fd)
        return True

    def _root_still_there(self) -> bool:
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.root))
        except OSError:
            return False

    def _make_root_again(self) -> bool:
        """The root was removed (a whole store deleted under a running server): make it again and
        forget every handle below the old one. The old root's handle may be in use by another
        operation; it is closed with the tree, not now (its number must not be reused under it)."""
        try:
            makedirs_private(self.root)
            fd = os.open(self.root, DIR_FLAGS)
        except OSError:
            return False
        self._old_roots.append(self.fd)
        self.fd = fd
        for rel in list(self._kept):
            kept = self._kept.pop(rel)
            if self._uses[kept]:
                self._dropped.add(kept)  # closed by its last user
            else:
                del self._uses[kept]
                os.close(kept)
        return True

    def _still_there(self, fd: int, rel: tuple[str, ...]) -> bool:
        """The directory open as `fd` is the one `rel` names now (a comparison only: nothing is
        opened through what the name resolves to)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(os.path.join(*rel), dir_fd=self.fd, follow_symlinks=False))
        except OSError:
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds = [*self._kept.values(), *self._dropped, self.fd, *self._old_roots]
            self._kept.clear()
            self._dropped.clear()
            self._uses.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
