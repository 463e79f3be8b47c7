"""A hostile store: whoever can write to a tier can plant any bytes under any key. Each planted
value below is well-formed as far as its own checksums go; the reader must still refuse it (a miss,
counted), because it is not the chunk the reader planned. Runs on every tier kind."""
from __future__ import annotations

import os

import pytest
import torch

from kvtier.store import TieredStore
from kvtier.store import format as fmt
from kvtier.store.seal import Seal
from kvtier.store.validate import Expect, check

from store_testlib import KV_HEADS, LAYERS, make_ns, make_state, tokens

C = 16  # chunk tokens
SECRET = b"a store secret of 32 bytes......"


def _store(spec, ns, seal=Seal()):
    return TieredStore.open(spec, ns, chunk_tokens=C, seal=seal)


def _saved(store, n=C, seed=0):
    t = tokens(n, seed)
    k, v, _ = make_state(n, seed)
    store.save(t, 0, k, v, None)
    assert store.flush(30)
    return t, store.lookup(t)


def _layers(ns, n, seed=7):
    k, v, h = make_state(n, seed)
    return {layer: {"k": k[layer], "v": v[layer]} for layer in range(LAYERS)}


def _plant(store, packed):
    """Put `packed` in every tier in place of whatever the tier holds under its key. The memory tier
    of a sealed store refuses a chunk without a valid tag at put (it keeps headers parsed)."""
    for t in store.tiers:
        t.delete(packed.header.key)
        assert t.put(packed) or (t is store.memory and store.seal.sealed)


def _refused(store, ref):
    """The chunk is a miss through both read paths, and the store counted why."""
    assert store.read_layers(ref, range(LAYERS)) is None
    reads = store.planned_reads([ref])
    assert not reads.open()
    counted = sum(t["corrupt"] + t["errors"] + t["put_errors"] for t in store.stats()["tiers"].values())
    assert counted >= 1


@pytest.mark.parametrize("n", [2 * C, C // 2])
def test_a_chunk_claiming_another_span_is_a_miss(spec, ns, n):
    """Finding 1: a header claiming 2x (or half) the planned tokens under the right key."""
    store = _store(spec, ns)
    t, match = _saved(store)
    ref = match.chunks[0]
    _plant(store, fmt.pack(ns, store.root, ref.key, store.root, 0, 0, n < C, _layers(ns, n)))
    _refused(store, ref)
    assert store.lookup(t).num_tokens == 0  # the bad value was removed: the next request recomputes
    store.close()


@pytest.mark.parametrize("other", [dict(storage="float16"), dict(storage="int8"), dict(compute="bfloat16")])
def test_a_chunk_in_another_dtype_under_this_namespace_is_a_miss(spec, ns, other):
    store = _store(spec, ns)
    t, match = _saved(store)
    ref = match.chunks[0]
    foreign = make_ns(**other)  # packed as another namespace would, but claiming this one's digest
    _plant(store, fmt.pack(foreign, store.root, ref.key, store.root, 0, 0, False, _layers(foreign, C)))
    _refused(store, ref)
    store.close()


def test_a_chunk_with_other_shapes_is_a_miss(spec):
    ns = make_ns()
    store = _store(spec, ns)
    _, match = _saved(store)
    ref = match.chunks[0]
    from kvtier.store import StoreNamespace  # more heads, same byte size per token: only the shape tells
    wide = StoreNamespace("model-a", LAYERS, KV_HEADS * 2, ns.head_dim // 2, ns.hidden_size)
    k = torch.randn(LAYERS, C, KV_HEADS * 2, ns.head_dim // 2)
    layers = {layer: {"k": k[layer], "v": k[layer]} for layer in range(LAYERS)}
    _plant(store, fmt.pack(wide, store.root, ref.key, store.root, 0, 0, False, layers))
    _refused(store, ref)
    store.close()


@pytest.mark.parametrize("parent", ["/abs/dir", "../../escape", "ab/../../x", "x" * 32])
def test_a_parent_that_is_not_a_chunk_key_is_refused_and_never_a_path(tmp_path, ns, parent):
    """Finding 3: a partial chunk's disk path comes from its header's parent. A header from another
    tier naming a path is never read, never demoted, never written anywhere."""
    store = _store(f"memory:64MB,disk:{tmp_path}/d:64MB", ns)
    t = tokens(C // 2)
    spans = store.keys_for(t)
    packed = fmt.pack(ns, store.root, spans[0], parent, 0, 0, True, _layers(ns, C // 2))
    disk = store.tier("disk")
    assert not disk.put(packed)  # refused before any path is built
    store.memory.put(packed)  # planted in memory (as if promoted from Redis), then demoted on eviction
    store._demote(store.memory, spans[0])
    with pytest.raises(fmt.FormatError, match="not a chunk key"):
        check(packed.header, Expect(spans[0]), packed.nbytes)
    assert store.read_chunk(spans[0]) is None
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [] and not os.path.exists("/abs/dir")
    store.close()


def test_junk_in_the_disk_partial_index_is_ignored(tmp_path, ns):
    """Finding 2 on disk: a junk file name in a partial directory is skipped, never parsed into an error."""
    store = _store(f"disk:{tmp_path}/d:64MB", ns)
    t, _ = _saved(store, C + 5)  # one full chunk and a 5-token partial
    pdirs = [p for p in tmp_path.rglob("p/*/*") if p.is_dir()]
    assert pdirs
    for name in ("x-y.kvc", "12-../../a.kvc", "-1-" + "0" * 32 + ".kvc", "abc", "99999999-" + "0" * 32 + ".kvc"):
        (pdirs[0] / name).write_bytes(b"junk") if "/" not in name else None
    reopened = _store(f"disk:{tmp_path}/d:64MB", ns)  # the index is rebuilt from the names too
    assert reopened.lookup(t).num_tokens == C + 5
    reopened.close()
    store.close()


def test_sealed_store_refuses_what_its_secret_did_not_seal(spec, ns):
    """Finding 4: with a secret, a chunk planted by anyone without it is a miss, whatever its checksums."""
    seal = Seal(SECRET)
    store = _store(spec, ns, seal)
    t, match = _saved(store)
    ref = match.chunks[0]
    assert store.read_layers(ref, range(LAYERS)) is not None  # its own sealed chunk reads back
    for forger in (Seal(), Seal(b"another secret, also 32 bytes..")):
        _plant(store, fmt.pack(ns, store.root, ref.key, store.root, 0, 0, False, _layers(ns, C), seal=forger))
        _refused(store, ref)
    store.close()


def test_sealed_chunk_moved_under_another_key_or_edited_is_a_miss(tmp_path, ns):
    seal = Seal(SECRET)
    store = _store(f"disk:{tmp_path}/d:64MB", ns, seal)
    t_a, match_a = _saved(store, seed=1)
    t_b, match_b = _saved(store, seed=2)
    path_a, path_b = (store.tier("disk").path_of(m.chunks[0].key) for m in (match_a, match_b))
    data = bytearray(open(path_a, "rb").read())
    data[-100] ^= 1  # a payload byte: BLAKE3 catches what a recomputed CRC would not
    open(path_a, "wb").write(bytes(data))
    assert store.read_layers(match_a.chunks[0], range(LAYERS)) is None
    assert store.read_layers(match_b.chunks[0], range(LAYERS)) is not None  # intact B is still served
    # B's genuine sealed bytes copied under another prompt's key: the key is inside the tag.
    t_c = tokens(C, 3)
    (key_c,) = store.keys_for(t_c)
    dest = os.path.join(os.path.dirname(os.path.dirname(path_b)), key_c[:2], key_c + ".kvc")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    open(dest, "wb").write(open(path_b, "rb").read())
    assert store.lookup(t_c).num_tokens == C  # found by name...
    assert store.read_layers(store.lookup(t_c).chunks[0], range(LAYERS)) is None  # ...never served
    store.close()


def test_unsealed_store_serves_a_moved_chunk_as_documented(tmp_path, ns):
    """What the docs say an unsealed store trusts: a chunk re-labelled with a valid CRC is served.
    (This is the reason for the secret; the test pins the documented limit.)"""
    store = _store(f"disk:{tmp_path}/d:64MB", ns)
    _, match = _saved(store, seed=1)
    t_c = tokens(C, 3)
    (key_c,) = store.keys_for(t_c)
    k, v, _ = make_state(C, 1)
    layers = {layer: {"k": k[layer], "v": v[layer]} for layer in range(LAYERS)}
    store.tier("disk").put(fmt.pack(ns, store.root, key_c, store.root, 0, 0, False, layers))
    assert store.read_layers(store.lookup(t_c).chunks[0], range(LAYERS)) is not None
    store.close()


def test_sealed_and_unsealed_servers_use_separate_chains(tmp_path, ns):
    spec = f"disk:{tmp_path}/d:64MB"
    sealed, plain = _store(spec, ns, Seal(SECRET)), _store(spec, ns)
    t, _ = _saved(sealed)
    assert plain.lookup(t).num_tokens == 0 and sealed.root != plain.root
    sealed.close()
    plain.close()


def test_store_secret_must_be_long_enough():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Seal(b"short")


# --- Redis: anyone with write access to the server can add members, change types, or lack rights ---

def _raw(store):
    return store.tier("redis").client


@pytest.mark.parametrize("junk", [[b"x:y"], [b"12:../../a", b"-3:" + b"0" * 32], [b"\xff\xfe", b"7"]])
def test_junk_partial_index_members_are_ignored_and_dropped(redis_url, ns, junk):
    """Finding 2: one SADD of a non-numeric member used to make every fresh prompt answer 500."""
    store = _store(redis_url, ns)
    t, _ = _saved(store, C + 5)  # a full chunk and a 5-token partial indexed under it
    tier = store.tier("redis")
    parent = store.keys_for(t)[0]
    _raw(store).sadd(tier._p(parent), *junk)
    assert store.lookup(t).num_tokens == C + 5  # the real partial is still found
    assert tier.counters["errors"] >= 1
    assert not set(junk) & _raw(store).smembers(tier._p(parent))  # the junk was removed
    store.close()


def test_index_and_chunk_keys_of_the_wrong_type_are_misses(redis_url, ns):
    store = _store(redis_url, ns)
    t, match = _saved(store, C + 5)
    tier, raw = store.tier("redis"), _raw(store)
    parent = store.keys_for(t)[0]
    raw.delete(tier._p(parent))
    raw.set(tier._p(parent), b"a string where a set belongs")  # WRONGTYPE on SMEMBERS
    assert store.lookup(t).num_tokens == C  # the full chunk only: the partial index is unreadable
    raw.delete(tier._c(parent))
    raw.hset(tier._c(parent), "a", "b")  # WRONGTYPE on STRLEN / GETRANGE
    assert store.read_layers(match.chunks[0], range(LAYERS)) is None
    assert tier.counters["errors"] >= 2
    store.close()


def test_an_acl_user_without_rights_on_the_prefix_gets_misses_not_errors(redis_server, ns):
    """Finding 2: a user that passes PING but may not touch the keys: every call is refused."""
    import redis

    admin = redis.Redis.from_url(redis_server)
    admin.execute_command("ACL", "SETUSER", "nokeys", "on", ">pw-nokeys", "~elsewhere:*", "+@all")
    host = redis_server.split("//", 1)[1]
    store = _store(f"redis://nokeys:pw-nokeys@{host}/0?prefix=acltest", ns)
    try:
        t = tokens(C + 5)
        k, v, _ = make_state(C + 5)
        store.save(t, 0, k, v, None)
        assert store.flush(30)
        assert store.lookup(t).num_tokens == 0  # a miss
        assert store.read_chunk(store.keys_for(t)[0]) is None
        st = store.stats()["tiers"]["redis"]
        assert st["errors"] >= 1 and st["put_errors"] >= 1
    finally:
        store.close()
        admin.execute_command("ACL", "DELUSER", "nokeys")


def test_a_value_longer_than_its_header_says_is_a_miss(tmp_path, ns):
    """Whole-value reads (promotion, demotion, verify) read the header first: a value padded to any
    length is refused on its header, before its size is trusted for a read."""
    store = _store(f"disk:{tmp_path}/d:64MB", ns)
    _, match = _saved(store)
    path = store.tier("disk").path_of(match.chunks[0].key)
    with open(path, "ab") as fh:
        fh.write(bytes(1 << 20))
    assert store.read_chunk(match.chunks[0]) is None
    assert store.read_layers(match.chunks[0], range(LAYERS)) is None
    store.close()


def test_an_order_claiming_a_huge_chunk_allocates_nothing(ns):
    packed = fmt.pack(ns, "0" * 32, "1" * 32, "0" * 32, 0, 0, False, _layers(ns, C),
                      order=torch.arange(C).expand(LAYERS, C).clone())
    raw = packed.to_bytes()
    n = fmt.header_length(raw[:fmt.PREAMBLE.size])
    doc = raw[fmt.PREAMBLE.size:n].decode().rstrip()
    forged = doc.replace(f'"tokens": {C}', '"tokens": 10000000000', 1)
    assert forged != doc
    body = forged.encode().ljust(n - fmt.PREAMBLE.size)
    import zlib
    pre = fmt.PREAMBLE.pack(fmt.MAGIC, 3, 0, len(body), zlib.crc32(body), bytes(32))
    with pytest.raises(fmt.FormatError, match="order"):
        fmt.parse_header(pre + body + raw[n:])


def test_planted_paths_and_odd_names_on_disk_are_misses_not_errors(tmp_path, ns):
    """A directory where a chunk file goes, a file where a directory goes, a partial name with a
    non-ASCII digit: lookups, reads, deletes and discards are misses, counted, never exceptions."""
    store = _store(f"disk:{tmp_path}/d:64MB", ns)
    t, match = _saved(store, C + 5)
    disk = store.tier("disk")
    (key_a,) = store.keys_for(tokens(C, 11))
    (key_b,) = store.keys_for(tokens(C, 12))
    nsdir = os.path.dirname(os.path.dirname(os.path.dirname(disk.path_of(match.chunks[0].key))))
    os.makedirs(os.path.join(nsdir, "c", key_a[:2], key_a + ".kvc"))  # a directory named like a chunk
    if not os.path.exists(os.path.join(nsdir, "c", key_b[:2])):
        open(os.path.join(nsdir, "c", key_b[:2]), "wb").close()  # a file where a directory goes
    pdir = [p for p in tmp_path.rglob("p/*/*") if p.is_dir()][0]
    (pdir / ("\u00b2-" + "0" * 32 + ".kvc")).write_bytes(b"x")  # "²".isdigit() is True
    assert store.lookup(tokens(C, 11)).num_tokens == 0
    assert store.lookup(tokens(C, 12)).num_tokens == 0
    assert store.lookup(t).num_tokens == C + 5
    store.discard([key_a, key_b])
    assert store.read_chunk(key_a) is None
    store.close()


def test_the_secret_is_the_same_from_every_source(monkeypatch, tmp_path):
    from kvtier.store.seal import load_secret

    (tmp_path / "s").write_text(SECRET.decode() + "\n")
    monkeypatch.setenv("KVTIER_STORE_SECRET", SECRET.decode() + "\n")
    ids = {load_secret(path=str(tmp_path / "s")).key_id(), load_secret().key_id(),
           load_secret(SECRET.decode() + " ").key_id()}
    assert len(ids) == 1 and "" not in ids


@pytest.mark.parametrize("bad", ["segment outside", "bytes short of the header"])
def test_the_memory_tier_refuses_a_chunk_inconsistent_with_itself_at_put(ns, bad):
    """The memory tier keeps headers parsed and checks reads only against what the reader expects,
    so what a header says of its own bytes is checked on the way in: an inconsistent chunk is
    refused (counted) and the chunk it would replace is a miss, not a read outside its bytes."""
    import dataclasses

    store = _store("memory:64MB", ns)
    _, match = _saved(store)
    ref = match.chunks[0]
    good = fmt.pack(ns, store.root, ref.key, store.root, 0, 0, False, _layers(ns, C))
    h = good.header
    if bad == "segment outside":
        seg = h.segments[-1]._replace(offset=h.total_bytes)
        packed = dataclasses.replace(good, header=dataclasses.replace(h, segments=h.segments[:-1] + (seg,)))
    else:
        packed = dataclasses.replace(good, buffers=good.buffers[:-1])
    store.memory.delete(ref.key)
    assert not store.memory.put(packed)
    assert store.stats()["tiers"]["memory"]["put_errors"] == 1
    assert store.memory.put(good)  # the consistent one goes in
    store.close()
