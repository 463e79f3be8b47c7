"""Blending over HTTP: a chat message's content parts and a completions prompt's separated parts
are documents; `blend` turns it off per request or is refused where the server does not blend."""
from __future__ import annotations

import httpx
import pytest

from kvtier.engine.config import ReuseConfig
from kvtier.planning.blend import BlendOptions
from kvtier.serve.config import ServeConfig

from serve_testlib import BODY_LIMIT, DEFAULT_MAX_TOKENS, serve

DOCS = ["the river runs north past the old mill and the stone bridge " * 3,
        "a red fox sleeps under the oak tree near the quiet pond " * 3]


@pytest.fixture(scope="module")
def blend_server(tiny_model):
    config = ServeConfig(default_max_tokens=DEFAULT_MAX_TOKENS, max_body_bytes=BODY_LIMIT, blend_separator="##")
    reuse = ReuseConfig(chunk_tokens=16, blend=BlendOptions(link_tokens=4))
    yield from serve(tiny_model, store="memory:64MB", reuse=reuse, config=config)


def _chat(url: str, docs=DOCS, **extra) -> httpx.Response:
    parts = [{"type": "text", "text": d} for d in docs]
    body = {"model": "tiny-gqa", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": parts}, {"role": "user", "content": "which animal?"}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_content_parts_blend_and_usage_says_how_much(blend_server):
    r = _chat(blend_server.url)
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["blended_tokens"] > 0 and details["recomputed_tokens"] > 0
    off = _chat(blend_server.url, blend=False)
    assert off.status_code == 200 and off.json()["usage"]["prompt_tokens_details"]["blended_tokens"] is None
    # The documents in the other order (this prompt's prefix is not in the device cache), naive.
    own = _chat(blend_server.url, DOCS[::-1], blend={"mode": "naive"})
    assert own.json()["usage"]["prompt_tokens_details"]["blended_tokens"] > details["blended_tokens"]


def test_a_completions_prompt_marks_the_parts_between_separators(blend_server):
    prompt = "Read these.##" + "##".join(DOCS) + "##Which animal?"
    r = httpx.post(blend_server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["blended_tokens"] > 0


@pytest.mark.parametrize("bad", [{"mode": "magic"}, {"link_tokens": -1}, {"ratio": 2}, {"extra": 1}, "yes", 1])
def test_bad_blend_values_are_400s_naming_the_field(blend_server, bad):
    r = _chat(blend_server.url, blend=bad)
    assert r.status_code == 400 and "blend" in r.text


@pytest.mark.parametrize("given, field", [({"mode": "legolink", "ratio": 0.3}, "ratio"),
                                          ({"ratio": 0.3}, "ratio"),  # the server's mode: legolink
                                          ({"mode": "naive", "link_tokens": 4}, "link_tokens"),
                                          ({"mode": "cacheblend", "link_tokens": 4}, "link_tokens")])
def test_a_blend_field_its_mode_does_not_read_is_a_400_naming_it(blend_server, given, field):
    r = _chat(blend_server.url, blend=given)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"blend.{field}", r.text
    assert _chat(blend_server.url, blend={"mode": "cacheblend", "ratio": 0.3}).status_code == 200


def test_asking_to_blend_where_the_server_does_not_is_a_400_naming_the_flag(tiny_server):
    r = _chat(tiny_server.url, blend=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "blend" and "--blend" in r.text
    assert _chat(tiny_server.url).status_code == 200  # content parts without --blend: a plain prompt


def test_too_many_content_parts_to_blend_is_a_400_naming_messages(blend_server):
    r = _chat(blend_server.url, ["x"] * 1025)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "1024" in r.text


@pytest.fixture(scope="module")
def corpus_server(tiny_model, tmp_path_factory):
    from kvtier.cli.engine_args import load_corpus

    corpus = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    corpus.write_text("".join(f'{{"text": "{d}"}}\n' for d in DOCS))
    config = ServeConfig(default_max_tokens=DEFAULT_MAX_TOKENS, max_body_bytes=BODY_LIMIT)
    served = serve(tiny_model, store="memory:64MB", reuse=ReuseConfig(chunk_tokens=16, blend=BlendOptions(link_tokens=4)),
                   config=config)
    server = next(served)
    load_corpus(server.engine, [str(corpus)])  # as --blend-corpus FILE does at start
    yield server
    served.close()


def _completion(url: str, prompt, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})


def _blended(r: httpx.Response) -> int | None:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["blended_tokens"]


def test_the_corpus_documents_are_found_in_prompts_that_mark_none(corpus_server):
    url = corpus_server.url
    text = f"Read these. {DOCS[1]}\n{DOCS[0]}\nWhich animal?"
    assert _blended(_completion(url, text)) > 0
    assert _blended(_completion(url, text, blend=False)) is None  # a request that refuses is not searched
    assert _blended(_completion(url, "Which animal sleeps near the pond? " * 3)) is None  # none in it
    chat = {"model": "tiny-gqa", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"{DOCS[0]}\n\nWhere does the river run?"}]}
    assert _blended(httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)) > 0
    # A prompt of token ids holds a document as its own ids (tokenized alone).
    engine = corpus_server.engine
    ids = engine.encode("Read this. ") + engine.encode(DOCS[1]) + engine.encode(" Which animal?")
    assert _blended(_completion(url, ids)) > 0


def test_a_prompt_built_to_match_the_corpus_everywhere_is_answered(corpus_server):
    # Each position starts a document's anchor; the search's comparisons are capped (test_corpus.py).
    flood = DOCS[0][:40] * 20
    assert _blended(_completion(corpus_server.url, flood)) is None  # no whole document in it: none blended
    assert _blended(_completion(corpus_server.url, flood + DOCS[1])) > 0  # the one after the flood is found


def test_a_bos_before_a_prompt_that_opens_with_a_document_stays_outside_its_span():
    from types import SimpleNamespace

    from kvtier.engine.corpus import Corpus
    from kvtier.serve.blend_inputs import marked_completion
    from kvtier.serve.schemas import CompletionRequest

    bos = 1

    def encode(text, special=False):  # a Llama-style tokenizer: a BOS where special tokens are added
        return ([bos] if special else []) + [ord(c) for c in text]

    corpus = Corpus()
    corpus.add([(DOCS[0], encode(DOCS[0]))])
    engine = SimpleNamespace(blend=BlendOptions(), encode=encode)
    body = CompletionRequest(model="tiny-gqa", prompt=DOCS[0] + "Which way?")
    ids, spans = marked_completion(engine, body, None, corpus.finder())
    assert ids[0] == bos and spans == ((1, 1 + len(DOCS[0])),) and ids[1:1 + len(DOCS[0])] == encode(DOCS[0])


def test_the_separator_is_markup_tokenize_counts_as_a_request_and_blend_false_takes_it_out(blend_server):
    """/tokenize counts what a completions request costs, separators taken out; a request that
    refuses to blend runs on the same text (the separators are the server's markup, never the
    prompt's words)."""
    prompt = "Read these.##" + "##".join(DOCS) + "##Which animal?"
    plain = "Read these." + "".join(DOCS) + "Which animal?"

    def completion(**fields):
        r = httpx.post(blend_server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def count(text):
        return httpx.post(blend_server.url + "/tokenize", json={"prompt": text}, timeout=60).json()["count"]

    assert count(prompt) == completion()
    assert completion(blend=False) == count(plain)


@pytest.mark.parametrize("part", ["im_start", "|>", "_end|"])
def test_a_part_never_cuts_the_templates_own_tokens_apart(blend_server, part):
    """A part found inside the template's markup (here inside <|im_start|>: the message's content
    occurs there first) would tokenize the markup as text: the prompt is then not marked, its
    tokens those of the prompt without blending."""
    r = _chat(blend_server.url, [part])
    off = _chat(blend_server.url, [part], blend=False)
    assert r.status_code == off.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == off.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens_details"]["blended_tokens"] is None


def test_a_part_is_found_in_its_messages_content_where_the_template_trims_it_or_moves_another():
    """As Llama 3's template trims each message's content, and Mistral's renders the system
    message inside the last user turn (after the documents' message)."""
    from types import SimpleNamespace

    from kvtier.serve.blend_inputs import marked_chat

    engine = SimpleNamespace(encode=lambda s: [ord(c) for c in s], model=SimpleNamespace(tokenizer=None))
    doc = "the river runs north past the old mill"
    contents = [("be brief", []), (doc + "\n ", [doc]), ("ok", []), ("where?", [])]  # parts: the document, a blank

    def render() -> str:  # the system message moved to the last turn, every content trimmed
        moved = contents[1:-1] + [(contents[0][0] + " " + contents[-1][0], [])]
        return "".join(f"<{i}>{c.strip()}</{i}>" for i, (c, _) in enumerate(moved))

    marked = marked_chat(engine, render, contents)
    assert marked is not None
    text = render()
    assert marked[1] == ((text.rindex(doc), text.rindex(doc) + len(doc)),)
