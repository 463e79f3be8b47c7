"""Grammar limits: each hostile spec refused by the limit it crosses, before the grammar engine
sees it; realistic specs (a 50-property schema, a 200-rule grammar, tool grammars) accepted; the
grammar threads' stack holds specs far deeper than the limits let through."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvtier.engine.grammar_limits import FLAGS, GrammarLimitError, GrammarLimits, _deepest_chain, check
from kvtier.engine.request import GrammarSpec
from kvtier.serve.tools import forced_grammar

LIMITS = GrammarLimits()


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def defs_chain(n: int) -> str:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def wide_schema(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"property_{i}": {"type": "string", "maxLength": 20}
                                                        for i in range(n)}})


def realistic_grammar(rules: int = 200) -> str:
    """A command language: `rules` rules, alternatives, groups, repetitions and regex terminals."""
    lines = ["start: command (\";\" command)*", "command: " + " | ".join(f"cmd{i}" for i in range(rules - 4)),
             "arg: NAME | NUMBER", "NAME: /[a-z][a-z0-9_]{0,15}/", "NUMBER: /[0-9]{1,6}/"]
    lines += [f'cmd{i}: "op{i}" ("(" arg ("," arg)* ")")?' for i in range(rules - 4)]
    return "\n".join(lines) + "\n"


HOSTILE = [
    (GrammarSpec("lark", lark_chain(4000)), "max_rules"),
    (GrammarSpec("lark", lark_chain(1000)), "max_depth"),
    (GrammarSpec("json_schema", defs_chain(4000)), "max_bytes"),
    (GrammarSpec("json_schema", defs_chain(300)), "max_depth"),
    (GrammarSpec("gbnf", gbnf_chain(3000)), "max_rules"),
    (GrammarSpec("gbnf", gbnf_chain(1000)), "max_depth"),
    (GrammarSpec("regex", "a{99999999}"), "max_repeat"),
    (GrammarSpec("regex", "(a{1000}){1000}"), "max_repeat"),
    (GrammarSpec("regex", "((a{10}b){100}){100}"), "max_repeat"),
    (GrammarSpec("lark", 'start: ("a"{1000}){1000}'), "max_repeat"),
    (GrammarSpec("lark", 'start: "a" ~ 5 ("b" ~ 100..200) ~ 100'), "max_repeat"),
    (GrammarSpec("lark", 'start: A\nA: /(x{500}){500}/'), "max_repeat"),
    (GrammarSpec("json_schema", wide_schema(10_000)), "max_bytes"),
    (GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "(a{1000}){1000}"})), "max_repeat"),
    (GrammarSpec("json_schema", "[" * 300 + "]" * 300), "max_depth"),
    (GrammarSpec("regex", "(" * 300 + "a" + ")" * 300), "max_depth"),
    (GrammarSpec("lark", "start: " + "(" * 300 + '"a"' + ")" * 300), "max_depth"),
    (GrammarSpec("gbnf", '\rroot ::= x\rx ::= ' + "(" * 300 + '"a"' + ")" * 300 + "\r"), "max_depth"),
    (GrammarSpec("lark", 'start[capture]: "a"{99999}'), "max_repeat"),
    (GrammarSpec("lark", 'start: "x" # "\n  | "a"{99999}\n'), "max_repeat"),
    (GrammarSpec("lark", 'junk before any rule "a"{99999}\nstart: "a"'), "max_repeat"),
    (GrammarSpec("regex", "a{100}{100}{100}"), "max_repeat"),
    (GrammarSpec("regex", "a{ 99999 }"), "max_repeat"),
    (GrammarSpec("regex", "a{" + "9" * 5000 + "}"), "max_repeat"),
    (GrammarSpec("lark", 'start: "a"{+99999}'), "max_repeat"),
    (GrammarSpec("lark", 'start: "a"~+99999'), "max_repeat"),
    (GrammarSpec("lark", 'start: "a"{,99999}'), "max_repeat"),
    (GrammarSpec("gbnf", 'root ::= "a"{ 99999 }'), "max_repeat"),
    (GrammarSpec("lark", 'start: %json {"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300),
     "max_depth"),
]


@pytest.mark.parametrize(("spec", "limit"), HOSTILE, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(HOSTILE)])
def test_each_hostile_spec_is_refused_by_the_limit_it_crosses(spec, limit):
    with pytest.raises(GrammarLimitError) as e:
        check(spec, LIMITS)
    assert FLAGS[limit] in str(e.value)


REALISTIC = [
    GrammarSpec("json_schema", wide_schema(50)),
    GrammarSpec("lark", realistic_grammar(200)),
    GrammarSpec("gbnf", 'root ::= item ("," item)*\nitem ::= [a-z]+ | "#" [0-9]{1,8}\n# a comment\n'),
    GrammarSpec("regex", r"\d{3}-[a-z]{2}(\.[A-Z]{1,100}){0,100}"),
    GrammarSpec("regex", "a{10000}"),
    GrammarSpec("regex", r"[{}()\[\]]{2}\{9999999\}"),  # escaped and in a class: no repetition
    GrammarSpec("lark", lark_chain(200)),
    GrammarSpec("json_schema", defs_chain(60)),
    GrammarSpec("json_schema", json.dumps({  # recursive: a tree
        "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                                                           "v": {"type": "integer"}}}}, "$ref": "#/$defs/node"})),
    GrammarSpec("json_object", ""),
    GrammarSpec("regex", r"\x{1F600}\x{20000}\p{L}{1,64}"),  # braces of an escape are no count
    GrammarSpec("lark", 'start{x}: x\n?item.2: "a"\n'),
]


@pytest.mark.parametrize("spec", REALISTIC, ids=[f"{s.kind}-{i}" for i, s in enumerate(REALISTIC)])
def test_realistic_specs_are_within_the_limits(spec):
    check(spec, LIMITS)


def test_a_tool_grammar_with_many_tools_is_within_the_limits():
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": json.loads(wide_schema(20))}}
             for i in range(20)]
    for family in ("hermes", "llama3_json"):
        check(GrammarSpec("lark", forced_grammar(tools, None, family, optional=True)), LIMITS)


@pytest.mark.parametrize(("limit", "at", "over"), [
    ("max_repeat", GrammarSpec("regex", "(a{100}){100}"), GrammarSpec("regex", "(a{100}){101}")),
    ("max_depth", GrammarSpec("lark", lark_chain(254)), GrammarSpec("lark", lark_chain(255))),
    ("max_rules", GrammarSpec("gbnf", gbnf_chain(1998)), GrammarSpec("gbnf", gbnf_chain(1999))),
])
def test_each_limit_holds_at_its_value_and_refuses_one_past(limit, at, over):
    limits = GrammarLimits(max_rules=2000, max_depth=10_000) if limit == "max_rules" else LIMITS
    check(at, limits)
    with pytest.raises(GrammarLimitError, match=FLAGS[limit]):
        check(over, limits)


def test_odd_text_is_a_limit_error_or_nothing():
    check(GrammarSpec("regex", "\ud800"), LIMITS)  # a lone surrogate: measured, not a crash
    with pytest.raises(GrammarLimitError, match="no rule"):
        check(GrammarSpec("lark", '"a"{5}'), LIMITS)


def test_size_is_counted_in_bytes():
    check(GrammarSpec("regex", "é" * 100), GrammarLimits(max_bytes=200))
    with pytest.raises(GrammarLimitError, match="201 bytes"):
        check(GrammarSpec("regex", "é" * 100 + "a"), GrammarLimits(max_bytes=200))


def test_the_deepest_chain_counts_a_cycle_once_and_takes_the_heaviest_path():
    weight = {"a": 1, "b": 2, "c": 3, "d": 1, "e": 5}
    refs = {"a": {"b"}, "b": {"c", "d"}, "c": {"b"}, "d": set(), "e": {"e"}}
    # a -> {b, c} (a cycle: 2 + 3) -> d: 1 + 5 + 1 = 7; e's self-loop: 5
    assert _deepest_chain(weight, refs) == 7
    assert _deepest_chain({"x": 1}, {"x": {"unknown"}}) == 1
    chain = {str(i): {str(i + 1)} for i in range(100_000)}  # deep: no recursion
    assert _deepest_chain(dict.fromkeys([*chain, "100000"], 1), chain) == 100_001


def test_the_grammar_threads_stack_holds_a_chain_that_kills_an_ordinary_thread(tmp_path):
    """Defence in depth: with the limits raised, a 4,000-rule chain (which overflows an 8 MiB stack)
    compiles on a grammar thread. Subprocesses, so a crash is a failed assertion, not a dead run."""
    script = textwrap.dedent(f"""
        import sys
        from kvtier.engine.factory import build_engine
        from kvtier.engine.grammar_limits import GrammarLimits
        from kvtier.engine.request import GrammarSpec
        from kvtier.engine.structured import _compile
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from test_grammar_limits import lark_chain
        g = build_engine("tiny-gqa", kv_cache_bytes=16 << 20, max_model_len=256).grammars
        g.limits = GrammarLimits(max_depth=100_000, max_bytes=1 << 20, max_rules=100_000)
        spec = GrammarSpec("lark", lark_chain(4000))
        if sys.argv[1] == "here":
            _compile(spec, g.tokenizer)
        else:
            print("done" if g.constraint(spec) else "none")
    """)
    run = [sys.executable, "-c", script]
    here = subprocess.run([*run, "here"], capture_output=True, text=True, timeout=300)
    assert here.returncode < 0, "the chain no longer overflows an ordinary stack: the test proves nothing"
    threads = subprocess.run([*run, "threads"], capture_output=True, text=True, timeout=300)
    assert threads.returncode == 0 and threads.stdout.strip() == "done", threads.stderr[-2000:]


def test_the_server_flags_set_the_limits():
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import from_args
    from kvtier.cli.serve import ServeOptions

    args = build_parser().parse_args(["serve", "--max-grammar-bytes", "1000", "--max-grammar-rules", "7",
                                      "--max-grammar-depth", "9", "--max-grammar-repeat", "11",
                                      "--grammar-timeout", "2.5"])
    assert from_args(ServeOptions, args).serve_config().grammar_limits == GrammarLimits(1000, 7, 9, 11, 2.5)
    assert ServeOptions().max_grammar_depth == GrammarLimits().max_depth
