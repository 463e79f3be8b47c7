"""The disk tier follows no symbolic link below its root and writes nothing outside it.

Whoever can write to the tier's directory can put a link where a directory or a file of the tier
goes. The tier must never follow one: no file outside the root is deleted, created or read, and a
link costs a miss or an unwritten chunk, counted and logged, never an exception. The operator's
root itself may be a link (a store directory on another disk): that one is followed, once.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

import pytest

from kvtier.cli import store as store_cli
from kvtier.store import TieredStore

from store_testlib import LAYERS, make_state, open_fds, tokens

C = 16  # chunk tokens: a full chunk of C tokens and a partial one of fewer have no lead directory
DEAD_PID = 4_194_305  # above Linux's largest pid: never a live writer


def _open(root: Path, ns) -> TieredStore:
    return TieredStore.open(f"disk:{root}:64MB", ns, chunk_tokens=C)


def _save(store: TieredStore, t: list[int], seed: int = 0) -> None:
    k, v, _ = make_state(len(t), seed)
    store.save(t, 0, k, v, None)
    assert store.flush(30)


def _ns_dir(root: Path, store: TieredStore) -> Path:
    assert store.root is not None
    return root / store.root


def _links(store: TieredStore) -> int:
    return store.stats()["tiers"]["disk"].get("links", 0)


def _errors(store: TieredStore) -> int:
    return store.stats()["tiers"]["disk"]["errors"]


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() or p.is_symlink())


def _planted(d: Path, names: list[str]) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for n in names:
        (d / n).write_bytes(b"not the tier's")
        out.append(d / n)
    return out


def _warned(caplog) -> bool:
    return any("not followed" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_linked_tmp_directory_is_not_emptied_at_start(tmp_path, ns, caplog):
    root, outside = tmp_path / "d", tmp_path / "outside"
    key = "0" * 32
    victims = _planted(outside, ["a.txt", "b", f"{key}.{DEAD_PID}.deadbeef.tmp", f"x.{DEAD_PID}.y.tmp"])
    store = _open(root, ns)
    t = tokens(C)
    _save(store, t)
    nsdir = _ns_dir(root, store)
    store.close()
    shutil.rmtree(nsdir / "tmp")
    (nsdir / "tmp").symlink_to(outside, target_is_directory=True)
    caplog.set_level(logging.WARNING)
    store = _open(root, ns)  # a start: stale temp files are cleaned up
    assert all(p.exists() for p in victims)
    assert _links(store) >= 1 and _errors(store) >= 1 and _warned(caplog)
    assert store.lookup(t).num_tokens == C  # reads need no tmp directory
    _save(store, tokens(C, 1), 1)  # a write through the link is skipped, not an exception
    assert _files(outside) == sorted(victims)
    assert store.lookup(tokens(C, 1)).num_tokens == 0
    store.close()


@pytest.mark.parametrize("where", ["c", "p"])
def test_a_linked_shard_directory_gets_no_chunk(tmp_path, ns, where, caplog):
    """`c`: the full chunk's shard; `p`: the shard of a partial chunk (and of full chunks' marks)."""
    root, outside = tmp_path / "d", tmp_path / "outside"
    outside.mkdir()
    store = _open(root, ns)
    _save(store, tokens(C, 5), 5)  # the namespace's directories exist
    nsdir = _ns_dir(root, store)
    t = tokens(C if where == "c" else C // 2)
    (key,) = store.keys_for(t)
    store.close()
    shard = nsdir / where / (key[:2] if where == "c" else str(store.root)[:2])
    if shard.exists():
        shutil.rmtree(shard)
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.symlink_to(outside, target_is_directory=True)
    caplog.set_level(logging.WARNING)
    store = _open(root, ns)
    _save(store, t)
    assert _files(outside) == []
    assert store.lookup(t).num_tokens == 0
    assert store.read_chunk(key) is None
    assert _links(store) >= 1 and _errors(store) >= 1 and _warned(caplog)
    store.close()


def test_a_linked_namespace_directory_is_never_written_or_chmodded(tmp_path, ns):
    root, outside = tmp_path / "d", tmp_path / "outside"
    outside.mkdir(mode=0o755)
    store = _open(root, ns)
    nsdir = _ns_dir(root, store)
    store.close()
    shutil.rmtree(nsdir)
    nsdir.symlink_to(outside, target_is_directory=True)
    store = _open(root, ns)  # opens: the tier is a miss for this namespace, not a crash
    t = tokens(C)
    _save(store, t)
    assert _files(outside) == [] and outside.stat().st_mode & 0o777 == 0o755
    assert store.lookup(t).num_tokens == 0
    assert _links(store) >= 1
    store.close()


def _relative_paths(tmp_path: Path, ns, t: list[int]) -> tuple[str, str]:
    """Where a save of `t` puts its full chunk and its mark, relative to the root (learned from a
    save into a scratch root: the same namespace and chunk size give the same paths)."""
    scratch = tmp_path / "scratch"
    with _open(scratch, ns) as s:
        _save(s, t)
    (chunk,) = scratch.rglob("*.kvc")
    (mark,) = scratch.rglob("*.kvl")
    return str(chunk.relative_to(scratch)), str(mark.relative_to(scratch))


@pytest.mark.parametrize("which", ["mark", "chunk"])
def test_a_dangling_link_at_a_mark_or_chunk_path_creates_nothing(tmp_path, ns, which):
    root, outside = tmp_path / "d", tmp_path / "outside"
    outside.mkdir()
    t = tokens(C)
    rel_chunk, rel_mark = _relative_paths(tmp_path, ns, t)
    store = _open(root, ns)  # planted while it runs (a start removes marks without their chunk)
    link = root / (rel_mark if which == "mark" else rel_chunk)
    link.parent.mkdir(parents=True, exist_ok=True)
    target = outside / "created-through-the-link"
    link.symlink_to(target)
    _save(store, t)
    assert not target.exists() and _files(outside) == []
    assert store.lookup(t).num_tokens == C  # the chunk itself is stored (a mark only helps partial reuse)
    store.close()


@pytest.mark.parametrize("reopen", [False, True])
def test_a_chunk_file_replaced_by_a_link_to_a_valid_chunk_is_a_miss(tmp_path, ns, reopen):
    root, outside = tmp_path / "d", tmp_path / "outside"
    outside.mkdir()
    store = _open(root, ns)
    t = tokens(C)
    _save(store, t)
    (key,) = store.keys_for(t)
    path = Path(store.tier("disk").path_of(key))
    elsewhere = outside / path.name
    shutil.move(path, elsewhere)  # the very chunk, valid, now outside the root
    path.symlink_to(elsewhere)
    if reopen:
        store.close()
        store = _open(root, ns)
    assert store.read_chunk(key) is None
    assert store.read_layers(key, range(LAYERS)) is None
    assert store.lookup(t).num_tokens == 0
    assert _links(store) >= 1
    assert elsewhere.exists()
    store.close()


@pytest.mark.parametrize("reopen", [False, True])
def test_a_fifo_in_place_of_a_chunk_file_is_a_miss_not_a_hang(tmp_path, ns, reopen):
    import threading

    root = tmp_path / "d"
    store = _open(root, ns)
    t = tokens(C)
    _save(store, t)
    (key,) = store.keys_for(t)
    path = Path(store.tier("disk").path_of(key))
    path.unlink()
    os.mkfifo(path)  # opening it for reading would wait for a writer that never comes
    if reopen:
        store.close()
        store = _open(root, ns)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.read_chunk(key)), daemon=True)
    reader.start()
    reader.join(20)
    assert got == [None]
    store.close()


def _clear(spec: str) -> int:
    p = argparse.ArgumentParser(prog="kvtier")
    store_cli.register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["store", "clear", "--store", spec])
    return args.func(args)


def test_store_clear_follows_no_link(tmp_path, ns, capsys):
    root, outside = tmp_path / "d", tmp_path / "outside"
    store = _open(root, ns)
    t = tokens(C + 5)
    _save(store, t)
    nsdir = _ns_dir(root, store)
    store.close()
    some_key = "ab" * 16
    planted = []
    # A link in the root, named and filled like a namespace of the tier.
    planted += _planted(outside / "ns" / "c" / "ab", [some_key + ".kvc"])
    planted += _planted(outside / "ns" / "tmp", [f"{some_key}.{DEAD_PID}.deadbeef.tmp"])
    planted += _planted(outside / "ns" / "p" / "ab" / some_key, [f"0005-{some_key}.kvl", f"0005-{some_key}.kvc"])
    (root / ("cd" * 16)).symlink_to(outside / "ns", target_is_directory=True)
    # Links inside a real namespace: a shard, a partial directory, the tmp directory, a file.
    planted += _planted(outside / "shard", [some_key + ".kvc"])
    (nsdir / "c" / "zz").symlink_to(outside / "shard", target_is_directory=True)
    planted += _planted(outside / "partial", [f"0005-{some_key}.kvl", f"0005-{some_key}.kvc"])
    (nsdir / "p" / "zz").mkdir(parents=True)
    (nsdir / "p" / "zz" / some_key).symlink_to(outside / "partial", target_is_directory=True)
    planted += _planted(outside / "tmp", [f"{some_key}.{DEAD_PID}.deadbeef.tmp", "keep.txt"])
    shutil.rmtree(nsdir / "tmp")
    (nsdir / "tmp").symlink_to(outside / "tmp", target_is_directory=True)
    planted += _planted(outside / "file", [some_key + ".kvc"])
    (nsdir / "c" / "ab").mkdir(parents=True, exist_ok=True)
    (nsdir / "c" / "ab" / (some_key + ".kvc")).symlink_to(outside / "file" / (some_key + ".kvc"))
    assert _clear(f"disk:{root}:64MB") == 0
    assert all(p.exists() for p in planted)
    assert not [p for p in root.rglob("*.kvc") if not p.is_symlink()]  # the tier's own chunks are gone
    assert "symbolic link(s)" in capsys.readouterr().out


def test_a_root_that_is_itself_a_link_works(tmp_path, ns):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    store = _open(link, ns)
    t = tokens(C + 5)
    _save(store, t)
    assert store.lookup(t).num_tokens == C + 5
    assert store.read_chunk(store.lookup(t).chunks[0]) is not None
    assert len(list(real.rglob("*.kvc"))) == 2
    assert _links(store) == 0 and _errors(store) == 0
    store.close()
    store = _open(link, ns)  # a restart finds them through the same link
    assert store.lookup(t).num_tokens == C + 5
    store.close()


def test_the_tiers_own_stale_temp_files_are_still_removed(tmp_path, ns):
    """Cleanup removes exactly the names the tier writes, of dead writers, and nothing else."""
    root = tmp_path / "d"
    store = _open(root, ns)
    _save(store, tokens(C))
    tmp = _ns_dir(root, store) / "tmp"
    store.close()
    key = "0" * 32
    stale = _planted(tmp, [f"{key}.{DEAD_PID}.deadbeef.tmp"])
    kept = _planted(tmp, [f"{key}.{DEAD_PID}.deadbeef.tmp.x", f"{key}.{DEAD_PID}.DEADBEEF.tmp", "other",
                          f"{key}.{os.getpid()}.0123abcd.tmp"])
    os.mkdir(tmp / f"{key}.{DEAD_PID}.0000aaaa.tmp")  # a directory with a temp file's name
    store = _open(root, ns)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept) and (tmp / f"{key}.{DEAD_PID}.0000aaaa.tmp").is_dir()
    store.close()


def test_clear_keeps_working_and_the_tier_writes_again(tmp_path, ns):
    """After a clear (which removes the tier's empty directories) the next writes land and read."""
    root = tmp_path / "d"
    store = _open(root, ns)
    t = tokens(C + 5)
    _save(store, t)
    store.clear()
    assert store.lookup(t).num_tokens == 0
    _save(store, t)
    assert store.lookup(t).num_tokens == C + 5
    store.close()


def test_directories_removed_behind_a_running_tier_are_made_again(tmp_path, ns):
    root = tmp_path / "d"
    store = _open(root, ns)
    _save(store, tokens(C + 5))
    nsdir = _ns_dir(root, store)
    for sub in ("c", "p", "tmp"):
        shutil.rmtree(nsdir / sub)
    t = tokens(C + 5, 3)
    _save(store, t, 3)
    assert store.lookup(t).num_tokens == C + 5
    store.close()


@pytest.mark.parametrize("few", [False, True])
def test_kept_handles_serve_every_shard_and_none_leaks(tmp_path, ns, monkeypatch, few):
    """With a small descriptor budget (`few`) most directories are opened per operation: the same
    results; either way no descriptor is left open once the tier closes."""
    from kvtier.store.tiers import disk

    if few:
        monkeypatch.setattr(disk, "fd_budget", lambda: 0)  # the floor: a few kept handles per root
    fds = open_fds()
    root = tmp_path / "d"
    store = _open(root, ns)
    prompts = [tokens(C + 5, s) for s in range(12)]  # full chunks in many shards, partials under many parents
    for s, t in enumerate(prompts):
        _save(store, t, s)
    assert all(store.lookup(t).num_tokens == C + 5 for t in prompts)
    assert not few or len(store.tier("disk").dirs[0].tree._kept) <= 8
    store.close()
    store = _open(root, ns)
    assert all(store.lookup(t).num_tokens == C + 5 for t in prompts)
    assert all(store.read_chunk(store.lookup(t).chunks[1]) is not None for t in prompts)
    store.clear()
    store.close()
    assert open_fds() - fds == set()
