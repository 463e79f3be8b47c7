"""Every request field is honoured or refused, never accepted and ignored (issue 29): the request
schemas are walked against docs/serve.md's "Request fields" table. A field missing from the table,
a refused field that is not refused with a 400 naming it, or an honoured field that names no test
of its effect fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest

from serve_testlib import TINY

ROOT = Path(__file__).parents[2]
SCHEMAS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MINIMAL = {"chat": {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
           "completions": {"model": TINY, "prompt": [5, 6], "max_tokens": 2}}

# Honoured fields -> the test that checks what they do (tests/serve/<file>::<function>).
EFFECT = {
    "blend": "test_serve_blend.py::test_content_parts_blend_and_usage_says_how_much",
    "model": "test_serve_bad_input.py::test_bad_json_body",
    "messages": "test_serve_openai.py::test_chat",
    "prompt": "test_serve_openai.py::test_completions_token_ids",
    "add_special_tokens": "test_serve_tokenize.py::test_completions_add_the_tokenizers_bos_unless_asked_not_to",
    "max_tokens": "test_serve_openai.py::test_chat_default_max_tokens_and_max_completion_tokens",
    "max_completion_tokens": "test_serve_openai.py::test_chat_default_max_tokens_and_max_completion_tokens",
    "temperature": "test_serve_sampling_fields.py::test_top_k_one_min_p_one_and_a_tiny_top_p_sample_the_greedy_tokens",
    "top_p": "test_serve_sampling_fields.py::test_top_k_one_min_p_one_and_a_tiny_top_p_sample_the_greedy_tokens",
    "top_k": "test_serve_sampling_fields.py::test_top_k_one_min_p_one_and_a_tiny_top_p_sample_the_greedy_tokens",
    "min_p": "test_serve_sampling_fields.py::test_top_k_one_min_p_one_and_a_tiny_top_p_sample_the_greedy_tokens",
    "presence_penalty": "test_serve_sampling_fields.py::test_fields_reach_the_engine",
    "frequency_penalty": "test_serve_sampling_fields.py::test_fields_reach_the_engine",
    "repetition_penalty": "test_serve_sampling_fields.py::test_repetition_penalty_changes_a_repetitive_continuation",
    "logit_bias": "test_serve_sampling_fields.py::test_logit_bias_bans_a_token",
    "min_tokens": "test_serve_sampling_fields.py::test_stop_token_ids_stop_and_min_tokens_holds_them_back",
    "stop_token_ids": "test_serve_sampling_fields.py::test_stop_token_ids_stop_and_min_tokens_holds_them_back",
    "stop": "test_serve_openai.py::test_stop_string",
    "ignore_eos": "test_serve_sampling_fields.py::test_fields_reach_the_engine",
    "seed": "test_serve_openai.py::test_seed_reproducible",
    "n": "test_serve_sampling_fields.py::test_n_samples_are_the_seeded_single_requests",
    "logprobs": "test_serve_sampling_fields.py::test_streamed_n_samples_logprobs_and_continuous_usage",
    "top_logprobs": "test_serve_structured.py::test_chat_logprobs_in_openai_shape",
    "prompt_logprobs": "test_serve_sampling_fields.py::test_prompt_logprobs_in_vllms_shape",
    "stream": "test_serve_openai.py::test_chat_stream_matches_plain",
    "stream_options": "test_serve_sampling_fields.py::test_streamed_n_samples_logprobs_and_continuous_usage",
    "response_format": "test_serve_structured.py::test_every_constraint_form_is_followed",
    "structured_outputs": "test_serve_structured.py::test_every_constraint_form_is_followed",
    "grammar": "test_serve_structured.py::test_every_constraint_form_is_followed",
    "tools": "test_serve_structured.py::test_tool_choice_none_hides_the_tools_and_auto_shows_them",
    "tool_choice": "test_serve_structured.py::test_forced_calls_on_the_random_model_parse_and_parallel_false_keeps_one",
    "parallel_tool_calls":
        "test_serve_structured.py::test_forced_calls_on_the_random_model_parse_and_parallel_false_keeps_one",
    "prompt_cache_key": "test_serve_security.py::test_keys_give_tenants_their_own_salts_and_sessions",
    "cache_salt": "test_serve_security.py::test_tenants_do_not_share_cached_prompts",
    "user": "test_serve_security.py::test_identifier_fields_are_capped",
    "add_generation_prompt":
        "test_serve_vllm_fields.py::test_add_generation_prompt_false_renders_without_the_assistant_header",
    "continue_final_message": "test_serve_vllm_fields.py::test_continue_final_message_continues_the_assistants_message",
    "chat_template_kwargs": "test_serve_vllm_fields.py::test_chat_template_kwargs_reach_the_template",
    "echo": "test_serve_vllm_fields.py::test_echo_prepends_the_prompt_or_the_final_assistant_message",
    "return_tokens_as_token_ids": "test_serve_vllm_fields.py::test_return_tokens_as_token_ids",
    "n_predict": "test_serve_vllm_fields.py::test_n_predict_is_max_tokens",
    "priority": "test_serve_vllm_fields.py::test_priority_orders_admission",
    "cache_prompt": "test_serve_vllm_fields.py::test_cache_prompt_false_neither_reuses_nor_saves",
}
# Refused fields -> a value that is not their neutral one.
NOT_NEUTRAL = {
    "suffix": "and then", "best_of": 2, "use_beam_search": True,
    "length_penalty": 0.5, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "truncate_prompt_tokens": 5, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": 'root ::= "a"',
    "store": True, "metadata": {"a": "b"}, "service_tier": "flex",
    "modalities": ["audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "audio": {"voice": "alloy"}, "web_search_options": {}, "verbosity": "low", "functions": [{"name": "f"}],
    "function_call": "auto",
}


def _table() -> dict[str, tuple[str, str]]:
    """docs/serve.md's request-field table: field -> (endpoint, status)."""
    text = (ROOT / "docs" / "serve.md").read_text()
    section = text[text.index("### Request fields"):]
    section = section[: section.index("\n### ", 1)]
    table = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            names, endpoint, status = (c.strip() for c in line.strip("|").split("|")[:3])
            for name in re.findall(r"`(\w+)`", names):
                table[name] = (endpoint, status)
    return table


TABLE = _table()


@pytest.mark.parametrize("endpoint", SCHEMAS)
def test_the_table_lists_every_field_of_the_schema_and_no_other(endpoint):
    fields = set(SCHEMAS[endpoint].model_json_schema()["properties"])
    listed = {f for f, (where, _) in TABLE.items() if where.startswith(("both", endpoint))}
    assert fields == listed, (fields - listed, listed - fields)
    assert all(status == "honoured" or status.startswith("refused") for _, status in TABLE.values())


def test_every_honoured_field_names_an_existing_test_of_its_effect():
    for field, (_, status) in TABLE.items():
        if status != "honoured":
            continue
        assert field in EFFECT, f"{field} is honoured: name the test of its effect in EFFECT"
        file, name = EFFECT[field].split("::")
        assert re.search(rf"^def {name}\(", (ROOT / "tests" / "serve" / file).read_text(), re.M), EFFECT[field]


def test_every_refused_field_is_refused_with_its_name(tiny_server):
    refused = {f: where for f, (where, status) in TABLE.items() if status.startswith("refused")}
    assert set(refused) == set(NOT_NEUTRAL)
    for field, where in refused.items():
        for endpoint in SCHEMAS if where == "both" else [where]:
            r = httpx.post(tiny_server.url + PATHS[endpoint], json={**MINIMAL[endpoint], field: NOT_NEUTRAL[field]},
                           timeout=60)
            assert r.status_code == 400, (endpoint, field, r.text)
            assert r.json()["error"]["param"] == field
