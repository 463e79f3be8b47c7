"""`kvtier precompile`: documents' state computed alone and stored, found stored the next time
(another process would read the same disk tier); bad input files are refused naming the line."""
from __future__ import annotations

import pytest

from kvtier.cli.main import main


def test_documents_are_stored_once_and_found_after(tmp_path, capsys, monkeypatch):
    # A home of its own: a hardware profile another test saves between the two runs would change
    # the layout the store's namespace is keyed by.
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    (tmp_path / "a.txt").write_text("a first document about rivers and bridges")
    (tmp_path / "b.jsonl").write_text('"a second document"\n\n{"text": "a third document"}\n')
    args = ["precompile", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--model", "tiny-gqa",
            "--dtype", "fp32", "--store", f"disk:{tmp_path}/store:64MB"]
    assert main(args) == 0
    assert "3 documents: 3 computed and stored, 0 stored already" in capsys.readouterr().out
    assert main(args) == 0
    assert "3 documents: 0 computed and stored, 3 stored already" in capsys.readouterr().out


def test_a_bad_line_is_refused_with_its_place(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('"fine"\n{"txt": "no text field"}\n')
    assert main(["precompile", str(tmp_path / "bad.jsonl"), "--model", "tiny-gqa", "--no-store"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_a_document_past_the_window_is_named_and_the_rest_stored(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text('"short"\n"' + "word " * 400 + '"\n')
    args = ["precompile", str(tmp_path / "docs.jsonl"), "--model", "tiny-gqa", "--max-model-len", "64",
            "--store", f"disk:{tmp_path}/store:64MB"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "document 1:" in captured.err and "1 computed and stored, 0 stored already, 1 refused" in captured.out


def test_blend_without_a_store_is_refused():
    from kvtier.cli.engine_args import EngineOptions

    with pytest.raises(ValueError, match="--no-store"):
        EngineOptions(model="tiny-gqa", blend=True, no_store=True).reuse()


def test_blend_corpus_needs_blend_and_files_it_can_read(tmp_path):
    from kvtier.cli.engine_args import EngineOptions

    with pytest.raises(ValueError, match="--blend-corpus sets how requests blend: add --blend"):
        EngineOptions(model="tiny-gqa", blend_corpus="docs.jsonl").blend_options()
    missing = tmp_path / "missing.jsonl"
    options = EngineOptions(model="tiny-gqa", dtype="fp32", store="memory:64MB", blend=True, blend_corpus=str(missing))
    with pytest.raises(ValueError, match="--blend-corpus: .*missing.jsonl"):
        options.build(measure_profile=False)
    (tmp_path / "docs.jsonl").write_text('"a first document about rivers and the bridges over them"\n"short"\n')
    options = EngineOptions(model="tiny-gqa", dtype="fp32", store="memory:64MB", blend=True,
                            blend_corpus=f"{tmp_path}/docs.jsonl, {tmp_path}/docs.jsonl")
    with options.build(measure_profile=False) as engine:
        doc = "a first document about rivers and the bridges over them"
        assert engine.corpus.find_text(f"x {doc} short") == [doc]  # once; "short" is too short to load
        assert len(engine.corpus) == 1


def test_document_files_are_read_as_they_appear_in_prompts_and_bad_ones_named(tmp_path):
    from kvtier.cli.document_files import read_documents

    (tmp_path / "a.txt").write_text("a document\n")
    assert read_documents([str(tmp_path / "a.txt")]) == ["a document"]  # the file's last line break is not its
    (tmp_path / "b.jsonl").write_text('"fine"\n{bad json}\n')
    with pytest.raises(ValueError, match="b.jsonl:2: not JSON"):
        read_documents([str(tmp_path / "b.jsonl")])
    (tmp_path / "c.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="c.txt: not UTF-8"):
        read_documents([str(tmp_path / "c.txt")])


def test_hostile_files_are_refused_naming_them_never_read_without_end(tmp_path, monkeypatch):
    import os

    from kvtier.cli import document_files
    from kvtier.cli.document_files import read_documents

    (tmp_path / "zero.txt").symlink_to("/dev/zero")  # a device behind a link: endless bytes
    os.mkfifo(tmp_path / "fifo.txt")  # no writer: opening it to read would wait forever
    (tmp_path / "dir.txt").mkdir()
    for name in ("zero.txt", "fifo.txt", "dir.txt"):
        with pytest.raises(OSError, match=f"{name}: not a regular file"):
            read_documents([str(tmp_path / name)])
    (tmp_path / "deep.jsonl").write_text('"fine"\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(ValueError, match="deep.jsonl:2: not JSON"):
        read_documents([str(tmp_path / "deep.jsonl")])
    monkeypatch.setattr(document_files, "MAX_DOCUMENT_BYTES", 100)
    (tmp_path / "long.jsonl").write_text('"fine"\n"' + "x" * 200 + '"\n')
    with pytest.raises(ValueError, match="long.jsonl:2: a line longer than"):
        read_documents([str(tmp_path / "long.jsonl")])
    (tmp_path / "big.txt").write_text("x" * 101)
    with pytest.raises(ValueError, match="big.txt: larger than"):
        read_documents([str(tmp_path / "big.txt")])
    (tmp_path / "ok.txt").write_text("x" * 99 + "\n")
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "ok.txt")  # a link to a regular file is read
    assert read_documents([str(tmp_path / "ok.txt"), str(link)]) == ["x" * 99, "x" * 99]
    # Line breaks read as Python reads text, whatever the file's convention.
    (tmp_path / "crlf.txt").write_bytes(b"line one\r\nline two\r\n")
    (tmp_path / "cr.jsonl").write_bytes(b'"a first"\r"a second"\r\n"a third"')
    assert read_documents([str(tmp_path / "crlf.txt"), str(tmp_path / "cr.jsonl")]) == [
        "line one\nline two", "a first", "a second", "a third"]
