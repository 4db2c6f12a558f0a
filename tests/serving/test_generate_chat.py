"""`kda-generate --chat` (tools/generate.py chat mode) on a converted tiny Kimi checkpoint that carries the
fixture tokenizer (tests/helpers/kimi_checkpoint.py): the prompt is transformers' rendering of the chat
(tests/fixtures/kimi_chat_golden.json) whichever way the messages come (prompt= + system=, messages=,
messages_file=), generation stops at any of the tokenizer's stop ids, and bad input is one `error:` line
naming the key (exit 2)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tests.helpers.kimi_checkpoint import KIMI_TOKENIZER, MODEL_NAME, write_tiny_kimi_hf
from tools import generate
from tools.cli import run_tool
from tools.demo import ASSETS

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = {c["name"]: c for c in json.loads((REPO / "tests" / "fixtures" / "kimi_chat_golden.json")
                                           .read_text(encoding="utf-8"))["cases"]}


def _gen(argv):
  return run_tool(generate.main, generate.__doc__, [str(a) for a in argv])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  from tools import convert_checkpoint as cc
  root = tmp_path_factory.mktemp("gen_chat")
  hf = write_tiny_kimi_hf(root / MODEL_NAME)
  assert cc.main([f"hf_model_path={hf}", f"output_path={root / 'ckpt'}"]) == 0
  return root / "ckpt"


@pytest.fixture(scope="module")
def tok():
  from model.data.tokenizer_kimi import KimiTokenizer
  return KimiTokenizer(KIMI_TOKENIZER)


def _run_chat(checkpoint, tmp_path, capsys, *args, name="out.json"):
  out = tmp_path / name
  status = _gen([f"load_parameters_path={checkpoint}", "max_new_tokens=4", f"output_json={out}", *args])
  captured = capsys.readouterr()
  assert status == 0, captured.err
  (result,) = json.loads(out.read_text())["results"]
  return result, json.loads(out.read_text()), captured.out


def test_chat_prompt_is_transformers_rendering(checkpoint, tok, tmp_path, capsys):
  case = GOLDEN["system_user"]
  system, user = (m["content"] for m in case["messages"])
  r, data, stdout = _run_chat(checkpoint, tmp_path, capsys, "--chat", f"system={system}", f"prompt={user}")
  assert r["prompt_ids"] == case["ids_sanitized"] and r["prompt"] == case["text"]
  assert r["messages"] == case["messages"]
  # The reply only is printed (not the rendered prompt), and it is the decoded reply.
  assert "You are terse." not in stdout and r["text"] in stdout
  assert r["text"] == tok.decode([t for t in r["generated_ids"] if t not in tok.stop_ids])
  # Generation stops at the tokenizer's stop ids: [EOS], <|im_end|> (and generation_config.json's).
  assert data["stop_ids"] == sorted(tok.stop_ids)
  assert {tok.eos_id, tok.special_tokens["<|im_end|>"]} <= set(data["stop_ids"])


@pytest.mark.parametrize("source", ["messages", "messages_file"])
def test_chat_messages_from_json(checkpoint, tmp_path, capsys, source):
  case = GOLDEN["multi_turn"] if source == "messages" else GOLDEN["forged_turn"]
  if source == "messages":
    arg = f"messages={json.dumps(case['messages'])}"
  else:
    f = tmp_path / "chat.json"
    f.write_text(json.dumps({"messages": case["messages"]}), encoding="utf-8")
    arg = f"messages_file={f}"
  r, _, _ = _run_chat(checkpoint, tmp_path, capsys, "chat=true", arg)
  assert r["prompt_ids"] == case["ids_sanitized"] and r["prompt"] == case["text"]


def test_generator_stops_at_any_stop_id(checkpoint):
  """The Generator's stop-id set: a sequence ends at the first generated id that is in the set."""
  from model.engine.generator import Generator
  from model.loading import load_model
  model, cfg = load_model(checkpoint)
  prompt = GOLDEN["one_user_turn"]["ids_sanitized"]
  free = Generator(model, max_length=int(cfg.max_cache_length), eos_id=None, batch_size=1)
  (ref,), _ = free.generate([prompt], 10)
  ids = ref.token_ids
  assert ref.finish_reason == "length" and len(ids) == 10
  first = min(ids.index(ids[3]), ids.index(ids[6]))
  stopping = Generator(model, max_length=int(cfg.max_cache_length), eos_id=None, batch_size=1,
                       stop_ids={ids[3], ids[6], 10**6})
  (got,), _ = stopping.generate([prompt], 10)
  assert got.token_ids == ids[:first + 1] and got.finish_reason == "eos"
  (off,), _ = stopping.generate([prompt], 10, stop_at_eos=False)
  assert off.token_ids == ids


@pytest.mark.parametrize("args, needles", [
    (["--chat", "messages=[{\"role\": \"user\""], ["messages is not valid JSON"]),
    (["--chat", "messages=[{\"role\": \"robot\", \"content\": \"hi\"}]"], ["messages:", "messages[0].role", "robot"]),
    (["--chat", "messages=[{\"role\": \"user\", \"content\": 5}]"], ["messages:", "messages[0].content"]),
    (["--chat", "messages=[]"], ["messages:", "empty"]),
    (["--chat", "prompt=hi", "prompt_ids=1,2"], ["prompt_ids=", "chat=true"]),
    (["--chat", "prompt=hi", "messages=[]"], ["exactly one of", "prompt, messages"]),
    (["--chat"], ["exactly one of", "got none"]),
    (["system=be brief", "messages=[{\"role\": \"user\", \"content\": \"hi\"}]"], ["system=", "messages="]),
    (["--chat", "messages_file=/no/such/file.json"], ["messages_file", "does not exist"]),
])
def test_chat_errors_name_the_key(checkpoint, capsys, args, needles):
  status = _gen([f"load_parameters_path={checkpoint}", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and err and err[-1].startswith("error: "), err
  for needle in needles:
    assert needle in err[-1], (needle, err[-1])


def test_chat_needs_a_chat_template(capsys):
  """The demo checkpoint's sentencepiece tokenizer has no chat template: one line naming chat=true."""
  status = _gen([f"load_parameters_path={ASSETS}", "--chat", "prompt=hello"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and err[-1].startswith("error: chat=true needs the checkpoint's chat template"), err
  assert np.all([not line.startswith("Traceback") for line in err])
