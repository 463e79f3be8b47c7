"""The reasoning parsers (kvtier/serve/reasoning.py) on their own: each parser's split of a whole
output, the streamed split (every way of cutting the text into deltas, tags cut included, gives
the whole split), the reading of the prompt's end, and a chat choice streamed and whole with one.
The server's side is tests/serve/test_serve_reasoning.py."""

from __future__ import annotations

import pytest

from kvtier.engine.engine import RequestOutput
from kvtier.serve.choices import ChatChoiceStream, TokenText, chat_choice
from kvtier.serve.reasoning import PARSERS, ReasoningParser, request_parser

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
OPEN = QWEN3.for_request("<|im_start|>assistant\n<think>\n")  # a template that opened the block

# text -> (qwen3's split, deepseek_r1's split)
CASES: dict[str, tuple[tuple[str | None, str | None], tuple[str | None, str | None]]] = {
    "<think>\nabc\n</think>\n\nyes": (("\nabc\n", "\n\nyes"), ("\nabc\n", "\n\nyes")),
    "\n<think>abc</think>yes": (("abc", "yes"), ("abc", "yes")),
    "<think>abc</think>": (("abc", None), ("abc", None)),
    "<think></think>yes": (("", "yes"), ("", "yes")),
    "<think>abc": (("abc", None), ("abc", None)),  # cut short: all thinking
    "abc</think>yes": ((None, "abc</think>yes"), ("abc", "yes")),  # deepseek_r1: the template opened it
    "plain answer": ((None, "plain answer"), ("plain answer", None)),
    "": ((None, ""), ("", None)),
    "  \n": ((None, "  \n"), ("  \n", None)),
    "<thin": ((None, "<thin"), ("<thin", None)),  # a start tag never finished is text
    "<think>a</thi": (("a</thi", None), ("a</thi", None)),  # so is an end tag
    "x<think>abc</think>yes": ((None, "x<think>abc</think>yes"), ("x<think>abc", "yes")),
    "<think>a</think>b<think>c</think>d": (("a", "b<think>c</think>d"), ("a", "b<think>c</think>d")),
    "<think>a<think>b</think>c": (("a<think>b", "c"), ("a<think>b", "c")),
    "<think>é🙂</think>ü": (("é🙂", "ü"), ("é🙂", "ü")),
}


@pytest.mark.parametrize("text", CASES)
def test_each_parser_splits_a_whole_output(text: str) -> None:
    qwen3, r1 = CASES[text]
    assert QWEN3.split(text) == qwen3
    assert R1.split(text) == r1
    assert OPEN.split(text) == r1  # qwen3 after a prompt that opened the block reads as deepseek_r1


def _cuts(text: str):
    """The text as deltas: char by char, and every cut in two and in three pieces."""
    yield list(text)
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for j in range(i, n + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", CASES)
def test_streamed_the_split_is_the_same_however_the_text_is_cut(parser: ReasoningParser, text: str) -> None:
    want_thought, want_said = parser.split(text)
    for deltas in _cuts(text):
        s = parser.splitter()
        thought, said = "", ""
        for d in [*deltas, None]:
            t, c = s.feed(d) if d is not None else s.finish()
            assert not (t and said), f"thinking after the answer began: {deltas}"
            thought, said = thought + t, said + c
        assert (thought if s.thought else None) == want_thought, deltas
        assert said == (want_said or ""), deltas


def test_a_tag_cut_across_deltas_is_held_back_until_the_next_says():
    s = QWEN3.splitter()
    assert s.feed("<th") == ("", "")  # may be the start tag
    assert s.feed("ink>abc</th") == ("abc", "")  # "</th" may be the end tag
    assert s.feed("ink>\nyes") == ("", "\nyes")
    assert s.finish() == ("", "")
    s = QWEN3.splitter()
    assert s.feed("<th") == ("", "")
    assert s.feed("ey") == ("", "<they")  # it was not a tag: the answer, held text first
    s = R1.splitter()
    assert s.feed("abc</") == ("abc", "")
    assert s.feed("b>") == ("</b>", "")  # not the end tag after all: thinking
    assert s.finish() == ("", "")


@pytest.mark.parametrize(("parser", "tail", "constrained", "inside"), [
    (QWEN3, "<|im_start|>assistant\n", False, False),
    (QWEN3, "<|im_start|>assistant\n<think>\n", False, True),  # a thinking-only template
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # enable_thinking false
    (R1, "<｜Assistant｜>", False, True),
    (R1, "<｜Assistant｜><think>\n", False, True),
    (R1, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),
    (R1, "<｜Assistant｜><think>\n", True, False),  # a grammar shapes the output from its first token
    (QWEN3, "<|im_start|>assistant\n<think>\n", True, False),
])
def test_the_prompts_end_says_where_the_output_begins(parser, tail, constrained, inside):
    assert parser.for_request(tail, constrained).inside is inside


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert not skip_special_tokens  # the tags are looked for whatever the tokenizer marks them
        return "".join({1: "<|im_start|>assistant\n", 2: "<think>", 3: "\n", 4: "</think>"}[i] for i in ids)


def test_request_parser_decodes_the_prompts_end():
    assert request_parser(None, _Tok(), [1, 2, 3], False) is None
    assert request_parser("qwen3", _Tok(), [1, 2, 3], False).inside
    assert not request_parser("qwen3", _Tok(), [1], False).inside
    assert not request_parser("deepseek_r1", _Tok(), [1, 2, 3, 3, 4, 3, 3], False).inside
    assert request_parser("deepseek_r1", None, [1], False).inside  # no tokenizer: the family's default
    assert request_parser("qwen3", _Tok(), [*(1,) * 40, 2, 3], False).inside  # only the end is decoded


def _out(deltas: list[str], reason: str = "stop") -> list[RequestOutput]:
    outs, text = [], ""
    for i, d in enumerate(deltas):
        text += d
        last = i == len(deltas) - 1
        outs.append(RequestOutput("r", 3, list(range(i + 1)), text, d, [i], last, reason if last else None,
                                  None, None, None, 0, 3))
    return outs


def test_a_chat_choice_streams_thinking_then_the_answer_and_whole_says_the_same():
    deltas = ["<th", "ink>\nab", "c\n</", "think>", "\n\nye", "s"]
    stream = ChatChoiceStream(0, None, True, TokenText(None, None), False, QWEN3)
    made = [c for out in _out(deltas) for c in stream.deltas(out)]
    got = [(c.delta.reasoning_content, c.delta.content, c.finish_reason) for c in made]
    assert got == [("\nab", None, None), ("c\n", None, None), (None, "\n\nye", None), (None, "s", None),
                   (None, None, "stop")]
    whole = chat_choice(_out(deltas)[-1], None, True, TokenText(None, None), reasoning=QWEN3)
    assert (whole.message.reasoning_content, whole.message.content) == ("\nabc\n", "\n\nyes")
    plain = chat_choice(_out(deltas)[-1], None, True, TokenText(None, None))
    assert (plain.message.reasoning_content, plain.message.content) == (None, "".join(deltas))
