"""Chat templates (model/data/chat_template.py) with the fixture Kimi tokenizer: the prompt string and ids
equal transformers' `apply_chat_template` (tests/fixtures/kimi_chat_golden.json, written in the reference
venv by tests/fixtures/make_kimi_chat_golden.py, and re-rendered live when .venv-ref exists); the
user's special-token strings never become control ids; bad messages and failing templates are typed
errors naming the field."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model.data.chat_template import (MARK_CLOSE, MARK_OPEN, ChatMessageError, ChatTemplate, ChatTemplateError,
                                      compile_template, normalize_messages)
from model.data.tokenizer_kimi import KimiTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "kimi_tokenizer"
GOLDEN = REPO / "tests" / "fixtures" / "kimi_chat_golden.json"
REF_PY = REPO / ".venv-ref" / "bin" / "python"
CASES = json.loads(GOLDEN.read_text(encoding="utf-8"))["cases"]
BASE = 2048


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
  return KimiTokenizer(FIXTURE)


def _kw(case):
  return {"add_generation_prompt": case["add_generation_prompt"], "tools": case.get("tools")}


def _structure_ids(tok, ids):
  return [i for i in ids if i >= BASE]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_same_prompt_as_transformers(tok, case):
  assert tok.render_chat(case["messages"], **_kw(case)) == case["text"]
  prompt = tok.encode_chat(case["messages"], **_kw(case))
  assert prompt.text == case["text"]
  # transformers' own guard (sanitize_control_tokens=True) gives the same ids, every case.
  assert prompt.ids == case["ids_sanitized"]
  if not case.get("forged"):
    # Nothing forged: also the plain HF ids (tokenizers' BPE, another implementation) and tiktoken's.
    assert prompt.ids == case["ids"] == tok._enc.encode(case["text"], allowed_special="all")
  else:
    assert prompt.ids != case["ids"]   # transformers without the guard made the user's strings control ids
  assert tok.decode(prompt.ids, skip_special_tokens=False) == case["text"]


def test_golden_cases_cover_the_structure():
  names = {c["name"] for c in CASES}
  assert {"one_user_turn", "multi_turn", "no_generation_prompt", "tools_and_calls", "forged_turn"} <= names
  assert any(not c["add_generation_prompt"] for c in CASES) and any(c["add_generation_prompt"] for c in CASES)


@pytest.mark.skipif(not REF_PY.exists(), reason=".venv-ref (transformers) is absent")
def test_transformers_renders_the_golden_again(tmp_path):
  out = tmp_path / "golden.json"
  proc = subprocess.run([REF_PY, REPO / "tests" / "fixtures" / "make_kimi_chat_golden.py", "--out", out],
                        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert json.loads(out.read_text(encoding="utf-8"))["cases"] == CASES


FORGERIES = ["<|im_end|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "[BOS]", "[EOS]",
             "<|tool_call_begin|>", "<|reserved_token_2100|>", MARK_OPEN, MARK_CLOSE, "<|", "|>", "system", "\n", "x"]


@given(st.lists(st.lists(st.sampled_from(FORGERIES), max_size=12).map("".join), min_size=1, max_size=4),
       st.booleans())
def test_user_text_never_becomes_a_control_token(tok, contents, gen):
  """The control ids are exactly those of the same chat with harmless content: the template's own."""
  roles = ["user", "assistant"]
  forged = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
  plain = [{"role": roles[i % 2], "content": "x"} for i in range(len(contents))]
  got = tok.encode_chat(forged, add_generation_prompt=gen)
  want = tok.encode_chat(plain, add_generation_prompt=gen)
  assert _structure_ids(tok, got.ids) == _structure_ids(tok, want.ids)
  assert tok.decode(got.ids, skip_special_tokens=False) == got.text


def test_forged_names_tools_and_kwargs(tok):
  msgs = [{"role": "user", "name": "<|im_middle|>", "content": "hi"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "<|tool_call_end|>", "function": {"name": "f", "arguments": {"<|im_end|>": "<|im_end|>"}}}]}]
  tools = [{"type": "function", "function": {"name": "<|im_system|>", "parameters": {}}}]
  got = tok.encode_chat(msgs, tools=tools)
  want = tok.encode_chat([{"role": "user", "name": "n", "content": "hi"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": "i", "function": {"name": "f", "arguments": {"k": "v"}}}]}],
                         tools=[{"type": "function", "function": {"name": "g", "parameters": {}}}])
  assert _structure_ids(tok, got.ids) == _structure_ids(tok, want.ids)


def test_escaped_markers_still_mark():
  """A template that writes user text through tojson(ensure_ascii=True) escapes the markers: still text."""
  t = ChatTemplate("{{ messages[0].content | tojson(ensure_ascii=True) }}<|im_end|>", {"<|im_end|>": 99})
  prompt = t.encode([{"role": "user", "content": "a<|im_end|>b"}], lambda s: [ord(c) for c in s])
  assert prompt.ids.count(99) == 1 and prompt.ids[-1] == 99


def test_list_content_is_joined(tok):
  parts = [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]
  assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "one two"
  assert tok.render_chat([{"role": "user", "content": parts}]) == \
      tok.render_chat([{"role": "user", "content": "one two"}])


BAD = [
    ("not a list", "messages", "must be a list"),
    ([], "messages", "empty"),
    (["hi"], "messages[0]", "must be an object"),
    ([{"content": "x"}], "messages[0].role", "missing"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "x"}], "messages[1].role", "'wizard'"),
    ([{"role": 3, "content": "x"}], "messages[0].role", "not supported"),
    ([{"role": "user"}], "messages[0].content", "missing"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content", "got an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content[0].type", "text only"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}],
     "messages[0].content[1].type", "missing"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "messages[0].content[0].text", "string"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]", "object"),
    ([{"role": "user", "content": "\ud800"}], "messages[0].content", "lone surrogate"),
    ([{"role": "user", "name": 5, "content": "x"}], "messages[0].name", "string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls", "only assistant"),
    ([{"role": "assistant", "tool_calls": "f()"}], "messages[0].tool_calls", "must be a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name", "non-empty"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "messages[0].tool_calls[0].function.arguments", "string"),
]


@pytest.mark.parametrize("messages, field, words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_messages_name_the_field(tok, messages, field, words):
  with pytest.raises(ChatMessageError, match=words) as e:
    tok.encode_chat(messages)
  assert e.value.field == field and str(e.value).startswith(field.split("[")[0])


def test_unsupported_features_of_a_template():
  t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
  call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
  with pytest.raises(ChatMessageError, match="renders no tool calls") as e:
    t.render([call])
  assert e.value.field == "messages[0].tool_calls"
  with pytest.raises(ChatMessageError, match="renders no tool results") as e:
    t.render([{"role": "tool", "content": "x"}])
  assert e.value.field == "messages[0].role"
  with pytest.raises(ChatMessageError, match="renders no tool definitions") as e:
    t.render([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
  assert e.value.field == "tools"
  with pytest.raises(ChatMessageError) as e:
    t.render([{"role": "user", "content": "x"}], tools="f")
  assert e.value.field == "tools"


def test_template_errors_are_typed():
  raising = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}"
                         "{% endif %}ok", {})
  assert raising.render([{"role": "user", "content": "x"}]) == "ok"
  with pytest.raises(ChatTemplateError, match="refused the messages: roles must alternate") as e:
    raising.render([{"role": "system", "content": "x"}])
  assert e.value.raised_by_template and e.value.field == "messages"
  with pytest.raises(ChatTemplateError, match="does not compile: line 1") as e:
    ChatTemplate("{% for m in messages %}", {})
  assert not e.value.raised_by_template
  with pytest.raises(ChatTemplateError, match="failed: TypeError"):
    ChatTemplate("{{ 1 + messages[0].content }}", {}).render([{"role": "user", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="failed: UndefinedError"):
    ChatTemplate("{{ messages[0].content.nope.deeper }}", {}).render([{"role": "user", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="failed: SecurityError"):   # the sandbox
    ChatTemplate("{{ ''.__class__.__mro__ }}", {}).render([{"role": "user", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="SecurityError"):
    ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([{"role": "user", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="SecurityError"):   # immutable: no list.append
    ChatTemplate("{% set l = [] %}{{ l.append(1) }}", {}).render([{"role": "user", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="empty"):
    ChatTemplate("  ", {})


def test_transformers_globals_and_filters():
  src = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
         "{{ m | tojson }}|{{ m | tojson(indent=1, sort_keys=True) }}|{{ {'a': 1, 'b': [1, 2]} | tojson(separators=(',', ':')) }}"
         "{% endfor %}{% set ns = namespace(n=0) %}{% set ns.n = 2 %}{{ ns.n }}{{ dict(a=1) | tojson }}"
         "{% generation %}G{% endgeneration %}{{ strftime_now('%Y') | length }}{{ extra }}")
  t = ChatTemplate(src, {}, {"bos_token": "<s>"})
  out = t.render([{"role": "user", "content": "é<>&", "name": None}, {"role": "user", "content": "skipped"}],
                 extra="!")
  assert out == ('<s>{"role": "user", "content": "é<>&"}|{\n "content": "é<>&",\n "role": "user"\n}|'
                 '{"a":1,"b":[1,2]}2{"a": 1}G4!')


def test_trim_and_lstrip_blocks():
  t = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}", {})
  assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_compiled_once():
  src = "{{ messages | length }}"
  assert compile_template(src) is compile_template(src)
  a, b = ChatTemplate(src, {}), ChatTemplate(src, {})
  assert a._template is b._template
