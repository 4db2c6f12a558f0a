"""The server's pieces without a server: OpenAI fields -> SamplingParams, request validation,
incremental text with stop strings, the serve tool's key checks (all before any model loads)."""

from __future__ import annotations

import pathlib
import re

import pytest

from model.config import load_config
from model.engine.api import SamplingParams
from model.errors import UsageError
from model.server import protocol
from model.engine.config import EngineConfig
from model.server.text import TextStream

REPO = pathlib.Path(__file__).resolve().parents[2]


class _CharTokenizer:
  """id i <-> chr(ord('a') + i) for i < 26; id 26 = a 3-byte character sent as 3 byte pieces (27, 28, 29)."""

  ids_only = False
  bos_id, eos_id = None, 30

  def decode(self, ids):
    out, pending = [], []
    for i in ids:
      if 27 <= i <= 29:
        pending.append(i)
        if len(pending) == 3:
          out.append("日")
          pending = []
        continue
      out.append("\ufffd" * len(pending))
      pending = []
      out.append(chr(ord("a") + i) if i < 26 else "")
    out.append("\ufffd" * len(pending))
    return "".join(out)

  def encode(self, text):
    return [ord(c) - ord("a") for c in text]


def _req(**kw):
  return protocol.CompletionRequest(prompt=[1, 2, 3], **kw)


@pytest.mark.parametrize("fields, want", [
    ({}, SamplingParams("greedy")),
    ({"temperature": 0}, SamplingParams("greedy")),
    ({"temperature": 0, "top_k": 5, "top_p": 0.5}, SamplingParams("greedy")),   # greedy ignores the filters
    ({"temperature": 0.7}, SamplingParams("weighted", 0.7)),
    ({"temperature": 0.7, "top_k": -1, "top_p": 1.0}, SamplingParams("weighted", 0.7)),
    ({"temperature": 0.7, "top_k": 5}, SamplingParams("topk", 0.7, top_k=5)),
    ({"temperature": 0.7, "top_p": 0.9}, SamplingParams("nucleus", 0.7, top_p=0.9)),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 0}, SamplingParams("nucleus", 0.7, top_p=0.9)),
])
def test_sampling_fields_map_to_one_strategy(fields, want):
  assert protocol.sampling_of(_req(**fields), vocab_size=100) == want


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
    ({"temperature": 1.0, "top_k": -2}, "top_k"), ({"temperature": 1.0, "top_k": 101}, "top_k"),
    ({"temperature": 1.0, "top_k": 5, "top_p": 0.5}, "top_k"),    # two filters at once: refused, not picked
])
def test_bad_sampling_fields_name_the_field(fields, param):
  with pytest.raises(protocol.ApiError) as e:
    protocol.sampling_of(_req(**fields), vocab_size=100)
  assert e.value.status == 400 and e.value.param == param


def _prepare(vocab=26, max_model_len=16, **fields):
  body = protocol.CompletionRequest(**{"prompt": [1, 2, 3], "max_tokens": 4, **fields})
  return protocol.to_engine_request(body, request_id="r", tokenizer=_CharTokenizer(), vocab_size=vocab,
                                    max_model_len=max_model_len, add_bos=True)


def test_a_valid_request_becomes_an_engine_request():
  p = _prepare(prompt="abc", max_tokens=5, stop=["xy"], seed=3)
  r = p.request
  assert r.prompt_ids == (0, 1, 2) and r.max_tokens == 5 and r.seed == 3 and r.stop_token_ids == {30}
  assert p.stop == ("xy",) and p.prompt_text == "abc"
  assert _prepare(ignore_eos=True).request.stop_token_ids == frozenset()


@pytest.mark.parametrize("fields, param, code", [
    ({"prompt": [1] * 16}, "prompt", "context_length_exceeded"),
    ({"prompt": [1] * 10, "max_tokens": 7}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"prompt": [1, 26]}, "prompt", "token_id_out_of_range"),
    ({"prompt": [-1]}, "prompt", "token_id_out_of_range"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": ["ab", "cd"]}, "prompt", "invalid_value"),
    ({"n": 2}, "n", "invalid_value"),
    ({"logprobs": 3}, "logprobs", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": -1.0}, "frequency_penalty", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
])
def test_bad_values_name_the_field(fields, param, code):
  with pytest.raises(protocol.ApiError) as e:
    _prepare(**fields)
  assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
  assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_neutral_penalties_and_stream_options_with_stream_are_accepted():
  p = _prepare(presence_penalty=0, frequency_penalty=0.0, stream=True, stream_options={"include_usage": True})
  assert p.request.prompt_ids == (1, 2, 3)


def test_an_empty_text_prompt_is_bos_alone_when_the_tokenizer_has_one():
  class WithBos(_CharTokenizer):
    bos_id = 25
  req = protocol.CompletionRequest.model_validate({"prompt": ""})
  p = protocol.to_engine_request(req, request_id="r", tokenizer=WithBos(), vocab_size=31, max_model_len=64,
                                 add_bos=True)
  assert p.request.prompt_ids == (25,) and p.prompt_text == ""
  with pytest.raises(protocol.ApiError, match="prepends no BOS"):
    protocol.to_engine_request(req, request_id="r", tokenizer=WithBos(), vocab_size=31, max_model_len=64,
                               add_bos=False)


def test_validation_errors_become_openai_bodies():
  import pydantic
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate({"max_tokens": 3})
  err = protocol.from_validation_error(e.value)
  assert (err.status, err.param, err.code) == (400, "prompt", "missing_field")
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate({"prompt": "a", "temprature": 1})
  assert protocol.from_validation_error(e.value).param == "temprature"


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a", "max_tokens": "16"}, "max_tokens"),      # a string is not coerced to a number
    ({"prompt": "a", "stream": "true"}, "stream"),            # nor to a boolean
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "n": True}, "n"),                        # a boolean is not an integer
    ({"prompt": 5}, "prompt"),                                # the union member ("prompt.str") is not named
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_wrong_json_types_are_refused_naming_the_field(fields, param):
  import pydantic
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate(fields)
  err = protocol.from_validation_error(e.value)
  assert (err.status, err.param, err.code) == (400, param, "invalid_value"), err.body()
  if param == "prompt" and not isinstance(fields["prompt"], list):
    assert "a list of integer token ids" in err.message and repr(fields["prompt"]) in err.message, err.message
  if param == "stop":
    assert err.message == "stop must be a string or a list of at most 4 strings (got 5)", err.message


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a", "bogus": 1}, "bogus"),
    ({"prompt": "a", "stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
])
def test_an_unknown_field_is_named_with_its_path(fields, param):
  import pydantic
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate(fields)
  err = protocol.from_validation_error(e.value)
  assert (err.status, err.param, err.code) == (400, param, "unknown_field"), err.body()
  assert err.message == f"{param} is not a field this server accepts"


@pytest.mark.parametrize("fields, param", [({"prompt": "a\ud800b"}, "prompt"),
                                           ({"prompt": "a", "stop": ["x", "\udfff"]}, "stop")])
def test_a_lone_surrogate_is_refused_naming_the_field(fields, param):
  req = protocol.CompletionRequest.model_validate(fields)
  with pytest.raises(protocol.ApiError) as e:
    protocol.to_engine_request(req, request_id="r", tokenizer=_CharTokenizer(), vocab_size=31, max_model_len=64,
                               add_bos=False)
  assert (e.value.status, e.value.param) == (400, param) and "lone surrogate" in e.value.message


def test_deeply_nested_json_is_a_400_not_a_crash():
  from model.server import app
  raw = b'{"prompt": "a", "stream_options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
  with pytest.raises(protocol.ApiError) as e:
    app._prepare(None, raw)
  assert (e.value.status, e.value.code) == (400, "invalid_json")


def test_an_integer_is_a_number():
  req = protocol.CompletionRequest.model_validate({"prompt": "a", "temperature": 1, "top_p": 1})
  assert req.temperature == 1.0 and req.top_p == 1.0


def _stream(ids, stop=()):
  s = TextStream(_CharTokenizer(), [0], stop, frozenset({30}))
  parts = [s.add(i) for i in ids]
  return parts, s.finish(), s


def test_text_streams_without_stop_strings():
  parts, tail, s = _stream([1, 2, 3])
  assert parts == ["b", "c", "d"] and tail == "" and s.text == "bcd"


def test_incomplete_characters_are_held_back():
  parts, tail, s = _stream([1, 27, 28, 29, 2])
  assert parts == ["b", "", "", "日", "c"] and "".join(parts) + tail == "b日c"


def test_stop_string_cuts_the_text_and_is_not_shown():
  parts, tail, s = _stream([1, 2, 3, 4, 5], stop=("de",))   # b c d e f
  assert s.stopped and s.text == "bc"
  assert "".join(parts) + tail == "bc" and parts[2] == ""    # "d" held back: it may start "de"
  assert parts[4] == ""                                      # nothing after the stop


def test_a_partial_stop_that_does_not_complete_is_released():
  parts, tail, s = _stream([3, 4, 4], stop=("dex",))          # d e e
  assert not s.stopped and "".join(parts) + tail == "dee" and parts[:2] == ["", ""]


def test_stop_tokens_are_never_text():
  parts, tail, s = _stream([1, 30])
  assert "".join(parts) + tail == "b"


def _whole_output_text(tok, prompt, ids, stop, hidden):
  """The oracle: the whole output decoded at once after the prompt's last ids, cut at the first stop."""
  ctx = [i for i in prompt[-8:] if i not in hidden]
  ids = [i for i in ids if i not in hidden]
  full, pre = tok.decode(ctx + ids), tok.decode(ctx)
  text = full[len(pre):] if full.startswith(pre) else tok.decode(ids)
  hits = [i for i in (text.find(s) for s in stop) if i >= 0]
  return text[:min(hits)] if hits else text


def test_incremental_text_equals_the_whole_output_decoded_with_the_demo_tokenizer():
  """Random outputs (ordinary pieces, byte-fallback runs that spell multi-byte characters or break
  them, EOS) streamed id by id concatenate to the whole-output decode, stop strings included."""
  import numpy as np
  from model.data.tokenizer import SentencePieceTokenizer
  from tools.demo import ASSETS
  tok = SentencePieceTokenizer(ASSETS / "tokenizer.model")     # pieces 5..260 are the 256 bytes
  rng = np.random.default_rng(0)
  utf8 = [b for ch in "日本語 Жж ü" for b in ch.encode()]
  for trial in range(400):
    n = int(rng.integers(1, 40))
    kind = trial % 4
    if kind == 0:
      ids = rng.integers(4, tok.vocab_size, n).tolist()
    elif kind == 1:
      ids = rng.integers(5, 261, n).tolist()                   # mostly invalid byte sequences
    elif kind == 2:                                            # valid characters as byte pieces, mixed in
      ids = [5 + utf8[int(rng.integers(len(utf8)))] if rng.random() < 0.5 else int(rng.integers(4, 1024))
             for _ in range(n)]
    else:
      ids = [5 + b for b in "日本 Ж".encode()] + rng.integers(4, 1024, n).tolist() + [3, 40]
    prompt = rng.integers(4, tok.vocab_size, int(rng.integers(0, 12))).tolist()
    stop = ("th", "e ") if trial % 2 else ()
    s = TextStream(tok, prompt, stop, frozenset({3}))
    streamed = "".join(s.add(i) for i in ids) + s.finish()
    want = _whole_output_text(tok, prompt, ids, stop, {3})
    assert streamed == want == s.text, (trial, prompt, ids)
    # each id's span of the decoded text: the spans tile it (the logprobs' tokens and text_offset)
    assert len(s.spans) == len(ids) and [a for a, _ in s.spans[1:]] == [b for _, b in s.spans[:-1]]
    assert s.spans[0][0] == 0 and (s.stopped or s.spans[-1][1] == len(s.decoded) and s.decoded == s.text)
    assert all(a == b for (a, b), i in zip(s.spans, ids) if i == 3)   # EOS: no text


class _DummyPrefixTokenizer(_CharTokenizer):
  """As _CharTokenizer, plus id 31 = a word-start space that a decode drops when it comes first (as
  sentencepiece with add_dummy_prefix drops the "▁" of a decode's first piece)."""

  def decode(self, ids):
    ids = list(ids)
    out, run = [], []    # runs of byte pieces decode together
    for i in ids + [None]:
      if i is not None and 27 <= i <= 29:
        run.append(i)
        continue
      if run:
        out.append(super().decode(run))
        run = []
      if i is not None:
        out.append(" " if i == 31 else super().decode([i]))
    text = "".join(out)
    return text[1:] if ids and ids[0] == 31 else text


def test_incremental_text_keeps_word_start_spaces_a_first_piece_would_drop():
  import numpy as np
  tok = _DummyPrefixTokenizer()
  rng = np.random.default_rng(1)
  for trial in range(300):
    ids = rng.choice([*range(26), 27, 28, 29, 30, 31, 31, 31], int(rng.integers(1, 30))).tolist()
    prompt = rng.choice([*range(26), 31], int(rng.integers(0, 10))).tolist()
    stop = ("a b",) if trial % 2 else ()
    s = TextStream(tok, prompt, stop, frozenset({30}))
    streamed = "".join(s.add(i) for i in ids) + s.finish()
    assert streamed == _whole_output_text(tok, prompt, ids, stop, {30}) == s.text, (trial, prompt, ids)


def test_each_token_decodes_a_bounded_window_not_the_whole_output():
  decoded_lengths = []

  class Counting(_CharTokenizer):
    def decode(self, ids):
      decoded_lengths.append(len(ids))
      return super().decode(ids)

  s = TextStream(Counting(), [0] * 20, (), frozenset({30}))
  out = "".join(s.add(i % 26) for i in range(2000)) + s.finish()
  assert out == "".join(chr(ord("a") + i % 26) for i in range(2000))
  assert max(decoded_lengths) <= 8 + 1 and len(decoded_lengths) <= 2 * 2000 + 1


@pytest.mark.parametrize("argv, key", [
    (["engine=bogus"], "engine"), (["max_num_seqs=0"], "max_num_seqs"), (["port=70000"], "port"),
    (["max_model_len=1"], "max_model_len"), (["prefix_cache_bytes=-1"], "prefix_cache_bytes"),
    (["host="], "host"), (["max_waiting=0"], "max_waiting"),
    (["engine=static", "max_num_partial_prefills=2"], "max_num_partial_prefills"),
    (["engine=static", "prefix_cache_bytes=1"], "prefix_cache_bytes"),
])
def test_serve_checks_its_keys_before_loading(argv, key):
  from tools import serve  # the tool module imports the server stack: only this test needs it
  with pytest.raises(UsageError, match=key):
    serve.run(["load_parameters_path=/nonexistent/for-this-test", *argv])


def test_static_engine_refuses_an_explicit_prefix_cache():
  with pytest.raises(UsageError, match="prefix_cache_bytes"):
    EngineConfig(engine="static", max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8, prefix_cache_bytes=1)
  with pytest.raises(UsageError, match="prefix_cache_bytes"):
    EngineConfig.from_config(load_config(["demo", "engine=static", "prefix_cache_bytes=1"]), ["prefix_cache_bytes"])
  # Not given: the default (the continuous engine's budget) is dropped, not refused.
  assert EngineConfig.from_config(load_config(["demo", "engine=static"])).prefix_cache_bytes == 0
  with pytest.raises(UsageError, match="engine must be"):
    EngineConfig(engine="dynamic", max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8)


def test_serving_keys_stay_out_of_checkpoints():
  import json
  from configs import base
  from model.config import checkpoint_json
  stored = json.loads(checkpoint_json(base.get_config()))
  for key in ("engine", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_waiting",
              "prefix_cache_bytes", "host", "port"):
    assert key in base.SERVING_KEYS and key not in stored, key


def test_max_num_partial_prefills_is_checked_before_anything_loads():
  """EngineConfig names max_num_partial_prefills above max_num_seqs (or negative); the static
  engine refuses the key rather than ignore it."""
  for value in (9, -1):
    cfg = load_config(["demo", "max_num_seqs=8", f"max_num_partial_prefills={value}"])
    with pytest.raises(UsageError, match="max_num_partial_prefills"):
      EngineConfig.from_config(cfg)
  assert EngineConfig.from_config(load_config(["demo", "max_num_seqs=8", "max_num_partial_prefills=8"])
                                  ).num_partial_prefills == 8
  assert EngineConfig.from_config(load_config(["demo", "max_num_seqs=2"])).num_partial_prefills == 2
  with pytest.raises(UsageError, match="max_num_partial_prefills"):
    EngineConfig(engine="static", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64,
                 max_num_partial_prefills=2)


def test_an_unexpected_exception_still_answers_an_openai_error_body():
  from fastapi.testclient import TestClient
  from model.server.app import build_app

  class Broken:
    @property
    def draining(self):
      raise ZeroDivisionError("a bug")

  client = TestClient(build_app(Broken()), raise_server_exceptions=False)
  r = client.post("/v1/completions", json={"prompt": "a"})
  assert r.status_code == 500
  err = r.json()["error"]
  assert (err["type"], err["code"]) == ("server_error", "internal_error") and "ZeroDivisionError: a bug" in err["message"]


class _ScriptedLoop:
  """An `EngineLoop` stand-in for the app: every request gets `ids` (logprob -(i+1)/10 for the i-th), the
  last with finish_reason "length"; `waiting` is what num_waiting() reports."""

  def __init__(self, ids, *, vocab=1024, max_model_len=256, waiting=0):
    from types import SimpleNamespace
    from model.engine.api import EngineStats
    self.engine = SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab)
    self.snapshot, self.alive, self.ids, self.waiting = EngineStats(), True, list(ids), waiting
    self.submitted, self.cancelled = [], []

  def num_waiting(self):
    return self.waiting

  def submit(self, request, sink):
    from model.engine.api import TokenEvent
    self.submitted.append(request)
    n = min(len(self.ids), request.max_tokens)
    for i, t in enumerate(self.ids[:n]):
      sink(TokenEvent(request.request_id, t, -(i + 1) / 10, "length" if i == n - 1 else None))

  def cancel(self, request_id):
    self.cancelled.append(request_id)


def _app_client(ids, **kw):
  from fastapi.testclient import TestClient
  from model.data.tokenizer import SentencePieceTokenizer
  from model.server.app import ServerState, build_app
  from tools.demo import ASSETS
  tok = SentencePieceTokenizer(ASSETS / "tokenizer.model")
  loop = _ScriptedLoop(ids(tok) if callable(ids) else ids, **kw)
  state = ServerState(loop, tok, model_name="demo", max_waiting=4)
  return TestClient(build_app(state), raise_server_exceptions=False), tok, loop


_OUT = "What light through yonder window breaks? It is the east"


def _sse_chunks(text):
  import json
  return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_logprobs_tokens_are_the_text_of_each_token():
  client, tok, _ = _app_client(lambda tok: tok.encode(_OUT))
  r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "logprobs": 1})
  choice = r.json()["choices"][0]
  lp = choice["logprobs"]
  n = len(tok.encode(_OUT))
  assert choice["text"] == _OUT and "".join(lp["tokens"]) == _OUT
  assert lp["tokens"][:4] == ["What", " li", "ght", " th"] and not any("\u2581" in t for t in lp["tokens"])
  assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n)]
  assert lp["token_logprobs"] == [-(i + 1) / 10 for i in range(n)] and lp["top_logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, text, tokens", [
    # " yonder window": six tokens (" y", "ond", "er", " w", "ind", "ow") spell the stop string: left out
    (" yonder window", "What light through", ["What", " li", "ght", " th", "r", "ough"]),
    # the stop string starts inside "ght": that token is kept whole, the rest left out
    ("ht thr", "What lig", ["What", " li", "ght"]),
])
def test_logprobs_stop_where_the_text_stops(stream, stop, text, tokens):
  client, tok, _ = _app_client(lambda tok: tok.encode(_OUT))
  body = {"prompt": "ROMEO:", "max_tokens": 40, "logprobs": 1, "stop": stop, "return_token_ids": True}
  if not stream:
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    got_text, lp, ids = choice["text"], choice["logprobs"], choice["token_ids"]
  else:
    chunks = [c["choices"][0] for c in _sse_chunks(client.post("/v1/completions", json={**body, "stream": True}).text)
              if c.get("choices")]
    got_text = "".join(c["text"] for c in chunks)
    lp = {k: [v for c in chunks for v in c["logprobs"][k]] for k in ("tokens", "token_logprobs", "text_offset")}
    ids = [t for c in chunks for t in c["token_ids"]]
  assert got_text == text
  assert lp["tokens"] == tokens
  assert lp["token_logprobs"] == [-(i + 1) / 10 for i in range(len(tokens))]
  assert lp["text_offset"] == [_OUT.index(t, sum(map(len, tokens[:i]))) for i, t in enumerate(tokens)]
  assert all(offset < len(text) for offset in lp["text_offset"])
  assert ids == tok.encode(_OUT)[:len(ids)] and len(ids) > len(tokens)   # token_ids: every generated id


def test_echoed_values_are_cut_in_error_messages():
  client, _, loop = _app_client([5, 6])
  name = "m" * 900_000
  r = client.post("/v1/completions", json={"model": name, "prompt": [2, 3]})
  err = r.json()["error"]
  assert r.status_code == 404 and (err["param"], err["code"]) == ("model", "model_not_found")
  assert f"the model '{'m' * 96}... does not exist" in err["message"] and len(err["message"]) < 200
  r = client.post("/v1/completions", json={"prompt": [2, 3], "k" * 500_000: 1})
  err = r.json()["error"]
  assert (r.status_code, err["code"]) == (400, "unknown_field") and len(err["message"]) < 200
  assert err["param"] == "k" * 97 + "..."
  r = client.post("/v1/completions", json={"prompt": [2, 3], "max_tokens": "x" * 500_000})
  err = r.json()["error"]
  assert (r.status_code, err["param"]) == (400, "max_tokens") and len(err["message"]) < 200
  r = client.get("/v1/" + "p" * 30_000)
  assert r.status_code == 404 and len(r.json()["error"]["message"]) < 200
  assert loop.submitted == []


def test_an_integer_of_too_many_digits_is_a_400_not_a_500():
  client, _, _ = _app_client([5])
  r = client.post("/v1/completions", content=b'{"prompt": [2, 3], "seed": ' + b"7" * 5000 + b"}",
                  headers={"Content-Type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("prompt, message", [
    ([1, 2, 3, "x"], 'prompt[3] must be an integer token id, got string "x"'),
    ([1, 2.5], "prompt[1] must be an integer token id, got number 2.5"),
    ([7, True], "prompt[1] must be an integer token id, got boolean true"),
    ([[5, 6, None]], "prompt[0][2] must be an integer token id, got null null"),
])
def test_a_bad_token_id_is_named_by_its_index(prompt, message):
  import pydantic
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate({"prompt": prompt})
  err = protocol.from_validation_error(e.value)
  assert (err.status, err.param, err.message) == (400, "prompt", message)


@pytest.mark.parametrize("fields, want", [
    ({"max_tokens": 1.0}, {"max_tokens": 1}), ({"seed": 7.0, "n": 1.0, "logprobs": 0.0}, {"seed": 7, "n": 1,
                                                                                         "logprobs": 0}),
    ({"top_k": 5.0}, {"top_k": 5}), ({"prompt": [1.0, 2.0]}, {"prompt": [1, 2]}),
    ({"prompt": [[3.0, 4]]}, {"prompt": [[3, 4]]}),
])
def test_an_integral_float_is_an_integer(fields, want):
  req = protocol.CompletionRequest.model_validate({"prompt": [1], **fields})
  for key, value in want.items():
    got = getattr(req, key)
    assert got == value and repr(got) == repr(value), (key, got)   # repr: 1, not 1.0
  p = _prepare(max_tokens=3.0, prompt=[1.0, 2.0])
  assert p.request.max_tokens == 3 and p.request.prompt_ids == (1, 2)


@pytest.mark.parametrize("fields, param", [({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
                                           ({"seed": 1e-3}, "seed"), ({"n": float("inf")}, "n")])
def test_a_non_integral_number_is_refused_for_an_integer_field(fields, param):
  import pydantic
  with pytest.raises(pydantic.ValidationError) as e:
    protocol.CompletionRequest.model_validate({"prompt": [1], **fields})
  err = protocol.from_validation_error(e.value)
  assert (err.status, err.param, err.code) == (400, param, "invalid_value")


def test_a_default_max_tokens_that_does_not_fit_says_it_was_the_default():
  with pytest.raises(protocol.ApiError) as e:
    _prepare(prompt=[1] * 10, max_model_len=20, max_tokens=None)
  assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
  assert "max_tokens=16 (the default: the request gives no max_tokens)" in e.value.message
  assert "pass a max_tokens of at most 10" in e.value.message
  req = protocol.CompletionRequest.model_validate({"prompt": [1] * 10})     # absent, not null
  with pytest.raises(protocol.ApiError, match=r"max_tokens=16 \(the default"):
    protocol.to_engine_request(req, request_id="r", tokenizer=_CharTokenizer(), vocab_size=26, max_model_len=20,
                               add_bos=False)
  with pytest.raises(protocol.ApiError) as e:
    _prepare(prompt=[1] * 10, max_model_len=20, max_tokens=16)           # given: no "default"
  assert "max_tokens=16 it needs 26" in e.value.message and "default" not in e.value.message


@pytest.mark.parametrize("waiting, text", [(10, "10 requests waiting"), (4, "4 requests waiting")])
def test_a_full_server_answers_503_with_retry_after(waiting, text):
  client, _, loop = _app_client([5], waiting=waiting)
  r = client.post("/v1/completions", json={"prompt": [2, 3]})
  err = r.json()["error"]
  assert (r.status_code, err["code"], r.headers.get("retry-after")) == (503, "max_waiting", "1")
  assert err["message"].startswith(text) and loop.submitted == []
  ok, _, _ = _app_client([5], waiting=3)
  r = ok.post("/v1/completions", json={"prompt": [2, 3]})
  assert r.status_code == 200 and "retry-after" not in r.headers


@pytest.mark.parametrize("live, line", [(1, "SIGTERM: draining (1 request in flight)"),
                                        (2, "SIGTERM: draining (2 requests in flight)"),
                                        (0, "SIGTERM: draining (0 requests in flight)")])
def test_the_drain_line_counts_requests_in_words(live, line, capsys):
  import signal
  import uvicorn
  from types import SimpleNamespace
  from model.server.runner import DrainingServer
  state = SimpleNamespace(live={f"r{i}" for i in range(live)}, draining=False)
  server = DrainingServer(uvicorn.Config(lambda scope, receive, send: None, log_config=None), state,
                          drain_timeout_s=1)
  server.handle_exit(signal.SIGTERM, None)
  assert capsys.readouterr().err.strip() == line and state.draining and server.should_exit


def test_tokenizer_path_none_serves_token_ids_only():
  """serve's tokenizer_path=none (README: none = unset) is no tokenizer: token-id prompts only; without the
  key the checkpoint's own copy is used."""
  from tools import cli
  from tools.demo import ASSETS
  overrides, cfg = cli.parse_args([f"load_parameters_path={ASSETS}", "tokenizer_path=none"])
  stored = cli.checkpoint_config(cfg, overrides)
  assert stored.tokenizer_path == "" and cli.tokenizer_for(stored).ids_only
  overrides, cfg = cli.parse_args([f"load_parameters_path={ASSETS}"])
  stored = cli.checkpoint_config(cfg, overrides)
  assert stored.tokenizer_path.endswith("tokenizer.model") and not getattr(cli.tokenizer_for(stored), "ids_only", False)


class _StatsEngine:
  """The least of an engine an `EngineLoop` needs before it starts: `stats()` (set `.stats_now`)."""

  def __init__(self, stats):
    self.stats_now = stats

  def stats(self):
    return self.stats_now


@pytest.mark.parametrize("engine_waiting, free, submitted, want", [
    (0, 8, 8, 0),     # a burst of 8 on an idle 8-slot server: all take slots at the next step
    (0, 8, 12, 4),    # 4 beyond the free slots wait
    (3, 0, 2, 5),     # every slot busy: the engine's waiting and the queued ones
    (5, 2, 0, 3),     # the engine's waiting beyond the slots freed since
])
def test_num_waiting_counts_requests_beyond_the_free_slots(engine_waiting, free, submitted, want):
  """`EngineLoop.num_waiting` (what max_waiting is compared with, and the waiting gauge): requests that
  will wait for a slot, not those a free slot takes at the next step (max_waiting=4 refused 4 of a
  burst of 8 on an idle 8-slot server)."""
  from model.engine.api import EngineStats, Request
  from model.server.loop import EngineLoop
  loop = EngineLoop(_StatsEngine(EngineStats(num_waiting=engine_waiting, num_free_slots=free)))
  for i in range(submitted):
    loop.submit(Request(f"r{i}", (2, 3), 1), lambda event: None)
  assert loop.num_waiting() == want


def test_token_counters_count_from_the_server_start():
  """The token counters of /metrics leave out what the engine counted before the server started (the
  warm-up request), as the request counters and histograms do."""
  from model.engine.api import EngineStats
  from model.server.metrics import ServerMetrics
  now = {"s": EngineStats(prompt_tokens=1, generated_tokens=1)}
  metrics = ServerMetrics(lambda: now["s"], lambda: 0)
  text = metrics.render().decode()
  assert "kda_prompt_tokens_total 0.0" in text and "kda_generation_tokens_total 0.0" in text
  now["s"] = EngineStats(prompt_tokens=601, cached_prompt_tokens=512, generated_tokens=21)
  text = metrics.render().decode()
  assert "kda_prompt_tokens_total 600.0" in text and "kda_cached_prompt_tokens_total 512.0" in text
  assert "kda_generation_tokens_total 20.0" in text
  assert re.search(r"^kda_prefix_cache_hit_rate 0\.853", text, re.M)


def test_sigterm_while_starting_exits_zero_with_a_line(tmp_path):
  """SIGTERM while the server still loads and compiles (before it listens): one line, status 0, as the
  drain after start-up ends (it used to end the process by the signal, status -15 / 143)."""
  import signal
  import subprocess
  import sys
  import time
  from tools.demo import ASSETS
  proc = subprocess.Popen([sys.executable, "-m", "tools.serve", f"load_parameters_path={ASSETS}", "port=0",
                           "max_num_seqs=2", "max_model_len=64", "max_num_batched_tokens=16"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    line = ""
    while "loading" not in line and time.monotonic() < deadline:   # past the key checks, into the load
      line = proc.stderr.readline()
    assert "loading" in line, line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-3000:]
  assert "SIGTERM: stopped before listening (nothing was served); exiting" in err and "listening on" not in out
