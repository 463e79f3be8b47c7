"""OpenAI tool calling on top of a model's chat template.

Two conventions for how a model writes a call are handled: the Hermes one (Qwen2/Qwen3/SmolLM2 and most
ChatML models put a JSON object between <tool_call> tags) and the Llama 3.x JSON one (a bare JSON object,
optionally after <|python_tag|>). This module turns OpenAI messages and tools into what a template can
render, reads calls back out of generated text, and builds the llguidance grammar that forces a call when
the request says tool_choice "required" or names a function.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

ToolFamily = Literal["hermes", "llama3_json"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

# Jinja expressions and statements; only names used inside them are variables the template reads.
_JINJA_TAG = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.DOTALL)
_JINJA_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
# `tools` as a bare name: not part of `tool_calls`, `my_tools` or an attribute such as `x.tools`.
_TOOLS_NAME = re.compile(r"(?<![\w.])tools\b")
# llguidance's JSON options for a forced call (see _call_schema).
_CALL_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A Hermes block; a model stopped by max_tokens or a stop string may never write the closing tag.
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text: OpenAI sends and returns arguments as a string


# ----- which convention a template uses ---------------------------------------------------------


def tool_family(chat_template: str | None) -> ToolFamily:
    """Which call format the template's model writes: "llama3_json" for Llama 3.x, else "hermes".

    Llama 3.x templates are recognised by the ipython environment they declare for tool use; every other
    common open model with tool support (and a plain ChatML template, which has no convention of its own)
    follows the Hermes <tool_call> format.
    """
    if chat_template and (PYTHON_TAG in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    """True when the template reads a `tools` variable, so it lays the tools out itself.

    Only the insides of Jinja tags count, with their string literals removed: a template whose literal
    text merely mentions tools does not render them.
    """
    if not chat_template:
        return False
    for match in _JINJA_TAG.finditer(chat_template):
        code = _JINJA_STRING.sub("", match.group(1) or match.group(2) or "")
        if _TOOLS_NAME.search(code):
            return True
    return False


# ----- requests: messages and tools for the template --------------------------------------------


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and the `tools` argument for apply_chat_template.

    A template that renders tools gets the conversation in the shape Hugging Face templates expect
    (call arguments as mappings, no None content) and the tools unchanged. A template that only knows
    role and content (SmolLM2's ChatML) gets everything as text: the tools described in the system
    message, past calls and their results written in the Hermes tags a model is asked to use.
    """
    if template_renders_tools(chat_template):
        return [_for_tool_template(m) for m in messages], (tools or None)
    out = [_as_text_message(m) for m in messages]
    if tools:
        block = _tools_system_text(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _for_tool_template(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    out["content"] = _content_text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [_call_with_mapping(call) for call in message["tool_calls"]]
    return out


def _call_with_mapping(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    function["arguments"] = _arguments_value(function.get("arguments"))
    return {**call, "function": function}


def _as_text_message(message: dict[str, Any]) -> dict[str, str]:
    role = str(message.get("role", "user"))
    content = _content_text(message.get("content"))
    if role == "tool":
        # ChatML has no tool role; the result goes back as a user turn, tagged so the model can tell.
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if role == "assistant" and message.get("tool_calls"):
        parts = [content] if content else []
        parts += [_call_block(call) for call in message["tool_calls"]]
        return {"role": role, "content": "\n".join(parts)}
    return {"role": role, "content": content}


def _call_block(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name", ""), "arguments": _arguments_value(function.get("arguments"))}
    return f"{CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_CLOSE}"


def _arguments_value(arguments: Any) -> Any:
    """Call arguments as an object when they are JSON text; otherwise as they came.

    Clients echo back whatever the model produced, which may be malformed; rendering it verbatim is
    better than refusing the whole conversation.
    """
    if not isinstance(arguments, str):
        return {} if arguments is None else arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts; only text reaches a text-only template
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _tools_system_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(
        json.dumps({"type": "function", "function": tool["function"]}, ensure_ascii=False) for tool in tools
    )
    return (
        "# Functions\n\n"
        "You can call functions to help with the user's request. Each available function is described by "
        "one JSON object per line between <tools> and </tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and its arguments (a JSON object) between "
        f"{CALL_OPEN} and {CALL_CLOSE}, one block per call:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CALL_CLOSE}'
    )


# ----- responses: calls out of generated text ---------------------------------------------------


def parse_tool_calls(text: str, family: ToolFamily, tool_names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls in a model's answer. Never raises: what is not a valid call is content.

    When no call is found the text comes back unchanged (None when blank), so a plain answer is not altered.
    """
    if family == "llama3_json":
        calls = _llama3_calls(text, tool_names)
        if calls:
            return None, calls
    else:
        content, calls = _hermes_calls(text, tool_names)
        if calls:
            return content, calls
    return (text if text.strip() else None), []


def _hermes_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept: list[str] = []
    start = 0
    for match in _CALL_BLOCK.finditer(text):
        call = _call_from_json(match.group(1).strip(), tool_names)
        if call is None:
            continue  # a block that is not a valid call stays in the content
        kept.append(text[start : match.start()])
        start = match.end()
        calls.append(call)
    kept.append(text[start:])
    content = "".join(kept).strip()
    return (content or None), calls


def _llama3_calls(text: str, tool_names: Collection[str]) -> list[ToolCall]:
    """All-or-nothing: the answer is a call (or several, joined by ';') only when every object is one."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = _skip_space(body, 0)
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return []
        call = _call_from_object(obj, tool_names, keys=("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)
        pos = _skip_space(body, pos)
        if pos < len(body):
            # Objects are decoded one at a time rather than split on ';' because a ';' may sit inside a string.
            if body[pos] != ";":
                return []
            pos = _skip_space(body, pos + 1)
    return calls


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _call_from_json(raw: str, tool_names: Collection[str]) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return _call_from_object(obj, tool_names)


def _call_from_object(obj: Any, tool_names: Collection[str], keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A call when `obj` names a known tool and its arguments (under the first of `keys` present) are an object.

    Missing arguments count as none: a model calling a function without parameters often leaves them out.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tool_names:
        return None
    arguments: Any = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def may_be_tool_call(text: str, family: ToolFamily) -> bool:
    """While streaming: could the text so far still turn into a tool call? If so the server holds it back."""
    head = text.lstrip()
    if family == "llama3_json":
        return _prefix_or_starts(head, PYTHON_TAG) or head.startswith("{")
    return _prefix_or_starts(head, CALL_OPEN)


def _prefix_or_starts(head: str, tag: str) -> bool:
    return tag.startswith(head) or head.startswith(tag)


# ----- forcing a call: llguidance grammars -------------------------------------------------------


def tag_tokens(tokenizer: Any) -> frozenset[str]:
    """The Hermes call tags that `tokenizer` has as added tokens (Qwen2.5's and Qwen3's do), for forced_grammar.

    The grammar engine takes every added token for a special one, which a grammar names as a token: written
    as text, the tag would be offered as its token and then refused.
    """
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is None:
        return frozenset()
    vocab = added()
    return frozenset(tag for tag in (CALL_OPEN, CALL_CLOSE) if tag in vocab)


def forced_grammar(tools: list[dict[str, Any]], choice: str | None, family: ToolFamily, optional: bool = False,
                   tokens: Collection[str] = ()) -> str:
    """A Lark grammar (llguidance dialect) whose only sentences are one call in the family's format.

    `choice` None means tool_choice "required": a call to any of the tools; otherwise a call to that function.
    The call's JSON is checked against the tool's parameters schema by llguidance's %json rule. `optional`
    (tool_choice "auto" with strict tools): a call, or text that does not begin like one. `tokens`: the tags
    the tokenizer has as added tokens (tag_tokens), written as token references (`<tool_call>`), not text.
    """
    functions = [tool["function"] for tool in tools]
    if choice is not None:
        functions = [f for f in functions if f.get("name") == choice]
        if not functions:
            raise ValueError(f"tool_choice names the function {choice!r}, which is not among the tools")
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool")
    key = "parameters" if family == "llama3_json" else "arguments"
    # Rule names are numbered: Lark rule names are lowercase identifiers and function names need not be.
    rules = [f"call_{i}: %json {json.dumps(_call_schema(f, key), ensure_ascii=False)}" for i, f in enumerate(functions)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    start = "start: call"
    if family == "hermes":
        start = f'start: {_tag(CALL_OPEN, tokens)} "\\n" call "\\n" {_tag(CALL_CLOSE, tokens)}'
    if optional:  # text may not begin with "<" (Hermes' tag) or, for Llama 3, "{" (a call) or "<" (its tag)
        start = start.replace("start: ", "start: TEXT | ") + "\nTEXT: " + (
            "/[^<][\\s\\S]*/" if family == "hermes" else "/[^{<][\\s\\S]*/")
    return "\n".join([start, call, *rules]) + "\n"


def _tag(tag: str, tokens: Collection[str]) -> str:
    """A tag in a Lark grammar: a token reference (llguidance's `<name>`) when it is one token, else text."""
    return tag if tag in tokens else json.dumps(tag)


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    parameters = dict(function.get("parameters") or {"type": "object"})
    # Local references ("#/$defs/...") resolve from the document root, which is now the wrapper object.
    hoisted = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
    return {
        # Fixed spacing, that of json.dumps (and of the calls the templates render into the history): with free
        # whitespace a small model may pad with newlines until max_tokens.
        "x-guidance": _CALL_JSON_FORMAT,
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
        **hoisted,
    }
