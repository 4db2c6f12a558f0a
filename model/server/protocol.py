"""The OpenAI-compatible request schemas, their validation, and the error body of every refusal.

`CompletionRequest` is the body of `POST /v1/completions` (the legacy completions API as OpenAI and
vLLM define it; `top_k`, `ignore_eos` and `return_token_ids` are vLLM's extensions, with vLLM's names).
Pydantic checks the types; `to_engine_request` checks the values against the served model and
builds the `model.engine.api.Request`. Every refusal is an `ApiError`, answered as

    {"error": {"message": ..., "type": ..., "param": <the field at fault or null>, "code": ...}}

with the HTTP status it carries (400 invalid_request_error for bad input, 404 for an unknown model or
route, 413 for an oversized body, 503 when the server is full or draining; the 503 of a full server
carries `Retry-After`). A value echoed in a message is cut to ECHO_LIMIT characters ("..." marks the cut).

Integer fields (max_tokens, n, logprobs, seed, top_k, the ids of a token-id prompt) accept an integral
JSON float (1.0, as OpenAI and vLLM do) and refuse any other non-integer (1.5, "1", true).

Sampling (how the OpenAI fields map to `model.engine.api.SamplingParams`):
- `temperature` absent or 0: greedy (argmax); `top_k` / `top_p` are then not used.
- `temperature` > 0 and neither filter: "weighted" (a draw from softmax(logits / temperature)).
- `top_k` >= 1 (-1 or 0 = off, as vLLM): "topk"; `top_p` < 1 (1 or absent = off): "nucleus".
- Both filters on at once is refused (400 naming `top_k`): the sampling strategies apply one filter
  each, and picking one silently would sample from another distribution than the one asked for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from collections.abc import Sequence
from typing import Annotated

import pydantic

from model.data.chat_template import ChatMessageError, ChatTemplateError
from model.engine.api import GenerationError, Request, SamplingParams


class ApiError(Exception):
  """A refused request: the HTTP status and the fields of the OpenAI error body."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error", headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
    self.headers = headers   # extra HTTP headers of the answer (Retry-After)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
  """400 invalid_request_error naming `param` (code `invalid_value` unless a more specific one is given)."""
  return ApiError(400, message, param, code)


def from_validation_error(e: pydantic.ValidationError | list) -> ApiError:
  """The 400 of pydantic's (or FastAPI's) first validation error, `param` the field's dotted path."""
  errors = e.errors() if isinstance(e, pydantic.ValidationError) else list(e)
  first = errors[0]
  loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
  # pydantic names the union member that failed ("prompt.str", "prompt.list[int].0"): the param is the
  # field path up to the first part that is not a field name.
  param_parts = []
  for part in loc:
    if part not in _FIELD_NAMES:
      break
    param_parts.append(part)
  param = ".".join(param_parts or loc[:1]) or None
  if first.get("type") == "json_invalid":
    return bad_request(f"the request body is not valid JSON: {first.get('msg')}", None, "invalid_json")
  if first.get("type") == "missing":
    return bad_request(f"{param} is required", param, "missing_field")
  if first.get("type") == "extra_forbidden":   # the unknown key itself, under its parent ("stream_options.bogus")
    unknown = cut(".".join(loc))
    return bad_request(f"{unknown} is not a field this server accepts", unknown, "unknown_field")
  if param in _UNION_FIELDS:   # pydantic's message names only one of the union's members
    whole = min(errors, key=lambda err: len(err.get("loc", ()))).get("input")   # the value, not a member's part
    element = _bad_token_id(whole) if param == "prompt" else None
    if element is not None:
      return bad_request(element, param, "invalid_value")
    return bad_request(f"{param} must be {_UNION_FIELDS[param]} (got {short(whole)})", param, "invalid_value")
  return bad_request(f"{param}: {first.get('msg')} (got {short(first.get('input'))})", param, "invalid_value")


_UNION_FIELDS = {"prompt": "a string, a list of integer token ids, or a list holding one of them",
                 "stop": "a string or a list of at most 4 strings"}
ECHO_LIMIT = 100   # characters of a request's value quoted back in an error message


def plural(n: int, word: str) -> str:
  """"1 request", "2 requests" (counts in messages and log lines)."""
  return f"{n} {word}" if n == 1 else f"{n} {word}s"


def cut(text: str, limit: int = ECHO_LIMIT) -> str:
  return text if len(text) <= limit else text[:limit - 3] + "..."


def short(value, limit: int = ECHO_LIMIT) -> str:
  """`repr(value)`, cut to `limit` characters (a 900 KB model name is not sent back whole)."""
  if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** limit:
    return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"   # (repr may refuse it)
  return cut(repr(value), limit)


def _is_id(value) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _bad_token_id(prompt) -> str | None:
  """'prompt[3] must be an integer token id, got str ...' for a token-id prompt (a list holding integers,
  or one such list in a list) with one element of another type; None for any other shape."""
  def first_bad(ids, path):
    if not any(_is_id(t) for t in ids) or any(isinstance(t, list) for t in ids):
      return None
    i = next((i for i, t in enumerate(ids) if not _is_id(t)), None)
    if i is None:
      return None
    return f"{path}[{i}] must be an integer token id, got {_json_type(ids[i])} {cut(json.dumps(ids[i]), 40)}"
  if not isinstance(prompt, list):
    return None
  if len(prompt) == 1 and isinstance(prompt[0], list):
    return first_bad(prompt[0], "prompt[0]")
  return first_bad(prompt, "prompt")


def _json_type(value) -> str:
  for kind, name in ((bool, "boolean"), (str, "string"), (int, "integer"), (float, "number"), (list, "array"),
                     (dict, "object")):
    if isinstance(value, kind):
      return name
  return "null"


def _integral(value):
  """An integral JSON float (1.0) as the integer it is; anything else unchanged (the strict check decides)."""
  if isinstance(value, float) and value.is_integer():
    return int(value)
  return value


# An integer field: 1.0 accepted as 1 (OpenAI and vLLM accept it), 1.5 / "1" / true refused.
Int = Annotated[int, pydantic.BeforeValidator(_integral)]


# strict: a JSON value of the wrong type is refused (400 naming the field), never coerced ("16" is not 16,
# "true" is not true); an integer is still accepted where a number is expected, as JSON has one number type.
_STRICT = pydantic.ConfigDict(extra="forbid", strict=True)


class StreamOptions(pydantic.BaseModel):
  model_config = _STRICT
  include_usage: bool = False


DEFAULT_MAX_TOKENS = 16   # OpenAI's default, when a request gives no max_tokens (or null)
MAX_N = 128               # choices one chat request may ask for (OpenAI's limit)


class CompletionRequest(pydantic.BaseModel):
  """The body of POST /v1/completions (unknown fields are refused by name, not ignored; values of the
  wrong JSON type are refused, not coerced)."""

  model_config = _STRICT

  model: str | None = None
  prompt: str | list[Int] | list[str] | list[list[Int]]
  max_tokens: Int | None = DEFAULT_MAX_TOKENS
  temperature: float | None = None
  top_p: float | None = None
  top_k: Int | None = None
  stop: str | list[str] | None = None
  seed: Int | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  logprobs: Int | None = None
  n: Int = 1
  echo: bool = False
  user: str | None = None
  presence_penalty: float | None = None  # accepted only at their neutral 0 (what many clients send by default)
  frequency_penalty: float | None = None
  ignore_eos: bool = False              # vLLM: generate max_tokens tokens even past EOS
  return_token_ids: bool = False        # vLLM: choices carry the generated ids as `token_ids`


class ChatCompletionRequest(pydantic.BaseModel):
  """The body of POST /v1/chat/completions (as `CompletionRequest`: unknown fields and values of the wrong
  JSON type are refused). `messages` is checked by `model.data.chat_template.normalize_messages`, so that
  its 400s name the element at fault (`messages[1].content`)."""

  model_config = _STRICT

  model: str | None = None
  messages: list
  max_tokens: Int | None = None
  max_completion_tokens: Int | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: Int | None = None
  stop: str | list[str] | None = None
  seed: Int | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  logprobs: bool | None = None          # accepted only false or null
  n: Int = 1
  user: str | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  tools: list | None = None             # given to the chat template (refused when it renders none)
  ignore_eos: bool = False
  return_token_ids: bool = False


# Every body field name: what `from_validation_error` keeps of pydantic's error locations.
_FIELD_NAMES = frozenset(CompletionRequest.model_fields) | frozenset(StreamOptions.model_fields) | frozenset(
    ChatCompletionRequest.model_fields)


def _stop_strings(stop) -> tuple[str, ...]:
  if stop is None:
    return ()
  stops = (stop,) if isinstance(stop, str) else tuple(stop)
  if len(stops) > 4:
    raise bad_request(f"stop holds {len(stops)} strings; at most 4 are accepted", "stop")
  if any(s == "" for s in stops):
    raise bad_request("stop strings must not be empty", "stop")
  for s in stops:
    _check_unicode(s, "stop")
  return stops


def _check_unicode(text: str, param: str) -> None:
  """400 naming `param` for text that is not valid Unicode (a lone surrogate such as "\\ud800", which
  JSON can spell but UTF-8 cannot encode, so neither the tokenizer nor generated text can hold it)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise bad_request(f"{param} is not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                      f"{e.start}", param, "invalid_value") from None


def sampling_of(req: CompletionRequest, vocab_size: int) -> SamplingParams:
  """The `SamplingParams` of the OpenAI fields (module docstring). Raises ApiError naming the field."""
  t = req.temperature
  if t is not None and (not math.isfinite(t) or t < 0):
    raise bad_request(f"temperature must be a finite number >= 0, got {t}", "temperature")
  if req.top_p is not None and not (math.isfinite(req.top_p) and 0.0 < req.top_p <= 1.0):
    raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
  if req.top_k is not None and req.top_k < -1:
    raise bad_request(f"top_k must be -1 or 0 (off) or an integer >= 1, got {short(req.top_k)}", "top_k")
  if req.top_k is not None and req.top_k > vocab_size:
    raise bad_request(f"top_k={short(req.top_k)} exceeds the vocabulary size {vocab_size}", "top_k")
  if t is None or t == 0:
    return SamplingParams("greedy")   # the canonical greedy params: one compiled function for every request
  top_k = req.top_k if req.top_k is not None and req.top_k >= 1 else None
  top_p = req.top_p if req.top_p is not None and req.top_p < 1.0 else None
  if top_k is not None and top_p is not None:
    raise bad_request("top_k and top_p cannot both filter one request (the sampling strategies apply one "
                      "filter each): pass top_k=-1 or top_p=1", "top_k")
  try:
    if top_k is not None:
      return SamplingParams("topk", float(t), top_k=top_k)
    if top_p is not None:
      return SamplingParams("nucleus", float(t), top_p=top_p)
    return SamplingParams("weighted", float(t))
  except GenerationError as e:  # the library's own check, should a rule above miss a case
    raise bad_request(str(e), "temperature") from None


class Prepared:
  """A validated completion: the engine request(s) plus what the response needs.

  `requests` holds one engine request per choice (`n` of a chat request; one for a completion),
  `request` is the first."""

  def __init__(self, request: Request | Sequence[Request], stop: tuple[str, ...], prompt_text: str | None,
               request_id: str | None = None):
    self.requests = (request,) if isinstance(request, Request) else tuple(request)
    self.request, self.stop, self.prompt_text = self.requests[0], stop, prompt_text
    self.request_id = request_id or self.request.request_id   # the response's id


def prompt_ids_of(req: CompletionRequest, tokenizer, *, add_bos: bool) -> tuple[list[int], str | None]:
  """`(ids, text or None)` of the request's one prompt. Raises ApiError naming `prompt`."""
  prompt = req.prompt
  if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
    if len(prompt) != 1:
      raise bad_request(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request "
                        f"(send several requests: they are batched on the server)", "prompt")
    prompt = prompt[0]
  if isinstance(prompt, str):
    _check_unicode(prompt, "prompt")
    if getattr(tokenizer, "ids_only", False):
      raise bad_request("prompt text needs a tokenizer and the served checkpoint has none: send token ids",
                        "prompt")
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    ids = bos + tokenizer.encode(prompt) if prompt else bos   # "" is BOS alone (OpenAI accepts it), if any
    if not ids:
      raise bad_request("prompt is empty (and the tokenizer prepends no BOS token to start from)", "prompt")
    return ids, prompt
  if not prompt:
    raise bad_request("prompt is empty (no token ids)", "prompt")
  return [int(t) for t in prompt], None


def to_engine_request(req: CompletionRequest, *, request_id: str, tokenizer, vocab_size: int,
                      max_model_len: int, add_bos: bool) -> Prepared:
  """Checks the values of `req` and builds the engine's `Request`.

  Raises:
    ApiError (400): n != 1, echo, a non-zero presence_penalty or frequency_penalty, stream_options
      without stream, logprobs outside [0, 1], max_tokens <= 0, a seed outside [0, 2**32),
      an empty prompt, token ids
      outside [0, vocab_size), a prompt of max_model_len tokens or more, prompt + max_tokens >
      max_model_len, and the sampling errors of `sampling_of`.
  """
  if req.n != 1:
    raise bad_request(f"n must be 1, got {short(req.n)}: send several requests instead", "n")
  if req.echo:
    raise bad_request("echo is not supported", "echo")
  for name in ("presence_penalty", "frequency_penalty"):
    value = getattr(req, name)
    if value is not None and value != 0:
      raise bad_request(f"{name} is not supported (only 0, no penalty), got {value}", name)
  if req.stream_options is not None and not req.stream:
    raise bad_request("stream_options is only allowed when stream is true", "stream_options")
  if req.logprobs is not None and not 0 <= req.logprobs <= 1:
    raise bad_request(f"logprobs must be 0 or 1 (the log-prob of the chosen token), got {short(req.logprobs)}",
                      "logprobs")
  defaulted = req.max_tokens is None or "max_tokens" not in req.model_fields_set
  max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
  if max_tokens <= 0:
    raise bad_request(f"max_tokens must be >= 1, got {short(max_tokens)}", "max_tokens")
  sampling = sampling_of(req, vocab_size)
  stop = _stop_strings(req.stop)
  ids, text = prompt_ids_of(req, tokenizer, add_bos=add_bos)
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise bad_request(f"prompt holds token ids outside the vocabulary [0, {vocab_size}): {short(bad[:8])}", "prompt",
                      "token_id_out_of_range")
  if len(ids) >= max_model_len:
    raise bad_request(f"prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves room for at most "
                      f"{max_model_len - 1} prompt tokens", "prompt", "context_length_exceeded")
  if len(ids) + max_tokens > max_model_len:
    given = (f"max_tokens={DEFAULT_MAX_TOKENS} (the default: the request gives no max_tokens)" if defaulted
             else f"max_tokens={short(max_tokens)}")
    raise bad_request(f"prompt has {len(ids)} tokens; with {given} it needs {short(len(ids) + max_tokens)} > "
                      f"max_model_len={max_model_len} tokens (pass a max_tokens of at most "
                      f"{max_model_len - len(ids)})", "max_tokens", "context_length_exceeded")
  request = Request(request_id, tuple(ids), int(max_tokens), sampling, _seed(req), _stop_ids(req, tokenizer))
  return Prepared(request, stop, text)


def _stop_ids(req, tokenizer) -> frozenset[int]:
  """The ids that end generation: the tokenizer's `stop_ids` (EOS; Kimi's <|im_end|> and the EOS ids of
  generation_config.json too), none with `ignore_eos`."""
  if req.ignore_eos:
    return frozenset()
  stops = getattr(tokenizer, "stop_ids", None)
  if stops is None:   # a duck-typed tokenizer with an eos id only
    eos = getattr(tokenizer, "eos_id", None)
    stops = () if eos is None else (eos,)
  return frozenset(int(t) for t in stops)


def _seed(req) -> int:
  if req.seed is not None and not 0 <= req.seed < 2**32:
    raise bad_request(f"seed must be in [0, 2**32), got {short(req.seed)}", "seed")
  return int(req.seed if req.seed is not None else secrets.randbits(31))


def chat_to_engine_request(req: ChatCompletionRequest, *, request_id: str, tokenizer, vocab_size: int,
                           max_model_len: int) -> Prepared:
  """Checks the values of a chat request, renders its messages with the tokenizer's chat template
  (`encode_chat`: special-token text in a message stays text) and builds the engine's `Request`.

  `max_completion_tokens` wins over `max_tokens` (OpenAI's deprecated name); with neither, the request
  may run to max_model_len. `n` > 1 gives n engine requests (`Prepared.requests`, ids
  `<request_id>-<i>`) of the same prompt, choice i drawn with seed + i (mod 2**32), as vLLM seeds the
  samples of one request; greedy choices are therefore identical.

  Raises:
    ApiError (400): as `to_engine_request` (penalties, stream_options without stream, sampling
      values, stop strings, seed), n outside [1, MAX_N], logprobs true, bad messages or tools (naming the field the chat
      template's checks name: `messages`, `messages[i].role`, `messages[i].content`, ...), a template
      that raised (`messages`), a prompt of max_model_len tokens or more (`messages`), prompt +
      max tokens > max_model_len (the max-tokens field given).
  """
  if not 1 <= req.n <= MAX_N:
    raise bad_request(f"n must be in [1, {MAX_N}], got {short(req.n)}", "n")
  for name in ("presence_penalty", "frequency_penalty"):
    value = getattr(req, name)
    if value is not None and value != 0:
      raise bad_request(f"{name} is not supported (only 0, no penalty), got {value}", name)
  if req.stream_options is not None and not req.stream:
    raise bad_request("stream_options is only allowed when stream is true", "stream_options")
  if req.logprobs:
    raise bad_request("logprobs is not supported by chat completions on this server", "logprobs")
  limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
  max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
  if max_tokens is not None and max_tokens <= 0:
    raise bad_request(f"{limit_param} must be >= 1, got {short(max_tokens)}", limit_param)
  sampling = sampling_of(req, vocab_size)
  stop = _stop_strings(req.stop)
  seed = _seed(req)
  try:
    prompt = tokenizer.encode_chat(req.messages, add_generation_prompt=True, tools=req.tools)
  except ChatMessageError as e:
    raise bad_request(str(e), e.field or "messages") from None
  except ChatTemplateError as e:
    raise bad_request(str(e), "messages", "chat_template_error") from None
  ids = list(prompt.ids)
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise bad_request(f"the rendered chat holds token ids outside the model's vocabulary [0, {vocab_size}): "
                      f"{short(bad[:8])}", "messages", "token_id_out_of_range")
  if len(ids) >= max_model_len:
    raise bad_request(f"the messages render to {len(ids)} tokens; max_model_len={max_model_len} leaves room for "
                      f"at most {max_model_len - 1} prompt tokens", "messages", "context_length_exceeded")
  if max_tokens is None:
    max_tokens = max_model_len - len(ids)
  elif len(ids) + max_tokens > max_model_len:
    raise bad_request(f"the messages render to {len(ids)} tokens; with {limit_param}={short(max_tokens)} it needs "
                      f"{short(len(ids) + max_tokens)} > max_model_len={max_model_len} tokens (pass a "
                      f"{limit_param} of at most {max_model_len - len(ids)})", limit_param, "context_length_exceeded")
  request = Request(request_id, tuple(ids), int(max_tokens), sampling, seed, _stop_ids(req, tokenizer))
  if req.n == 1:
    return Prepared(request, stop, prompt.text)
  return Prepared([dataclasses.replace(request, request_id=f"{request_id}-{i}", seed=(seed + i) % 2**32)
                   for i in range(req.n)], stop, prompt.text, request_id)

