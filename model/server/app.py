"""The FastAPI application: OpenAI-compatible routes in front of one `EngineLoop`.

Routes:
- `POST /v1/completions`: one prompt (text or token ids) per request; `stream=true` answers with
  server-sent events (`data: {chunk}` per text delta, then `data: [DONE]`; with
  `stream_options.include_usage` a last chunk carries `usage`). `logprobs=0|1` gives `tokens` (each
  token's text as it appears in the completion), `token_logprobs` (null where the engine reports
  none: the static engine) and `text_offset`; tokens cut by a stop string are left out.
  `return_token_ids=true` adds the generated ids (vLLM's field).
- `POST /v1/chat/completions`: chat messages rendered with the tokenizer's chat template
  (`protocol.chat_to_engine_request`; 400 `chat_template_missing` for a tokenizer without one). The
  answer is a "chat.completion" with `n` choices (index 0..n-1, each one engine request, run
  concurrently) whose `message` is {role, content}; `stream=true` sends "chat.completion.chunk"
  events, per choice a `{"role": "assistant"}` delta, content deltas and a chunk with `finish_reason`
  (choices interleaved as their tokens come), then the usage chunk with `stream_options.include_usage`
  (the prompt counted once, the completions of all choices), then `data: [DONE]`.
  `return_token_ids=true` adds each choice's `token_ids` and the prompt's `prompt_token_ids` (vLLM's fields).
- `GET /v1/models`, `GET /health` (503 while draining or when the engine loop is gone), `GET /metrics`.

Requests are validated before they reach the engine (`model.server.protocol`); every refusal has the
OpenAI error body. A handler never touches the engine: it submits to the loop and reads its events
from an asyncio queue. A client that goes away cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import fastapi
import prometheus_client
import pydantic
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from model.engine.api import TokenEvent
from model.engine.api import GenerationError
from model.server import protocol
from model.server.loop import EngineLoop
from model.server.metrics import ServerMetrics
from model.server.protocol import ApiError, bad_request
from model.server.text import TextStream

DISCONNECT_POLL_S = 0.25   # how often a non-streaming request looks whether its client is still there


class ServerState:
  """What the routes share: the loop, the tokenizer, the limits and the live requests.

  Args:
    loop: the started `EngineLoop`. tokenizer: the served checkpoint's (or ids-only) tokenizer.
    model_name: the id `/v1/models` lists and requests may name. max_waiting: waiting requests at
      which new ones get 503. max_body_bytes: larger bodies get 413. add_bos: prepend BOS to text
      prompts (the tokenizer's, when it has one).
  """

  def __init__(self, loop: EngineLoop, tokenizer, *, model_name: str, max_waiting: int,
               max_body_bytes: int = 1 << 20, add_bos: bool = True):
    self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
    engine = loop.engine
    self.max_model_len, self.vocab_size = int(engine.max_model_len), int(engine.vocab_size)
    self.max_waiting, self.max_body_bytes, self.add_bos = int(max_waiting), int(max_body_bytes), add_bos
    self.created = int(time.time())
    self.draining = False
    self.live: set[str] = set()     # requests the engine still holds (added, no final event yet)
    self.metrics = ServerMetrics(lambda: loop.snapshot, loop.num_waiting)


RETRY_AFTER_S = 1   # the Retry-After of a 503 max_waiting (a full server frees slots within seconds)


def _error(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(request: fastapi.Request, limit: int) -> bytes:
  length = request.headers.get("content-length")
  if length is not None and length.isdigit() and int(length) > limit:
    raise ApiError(413, f"the request body has {length} bytes; at most {limit} are accepted", None,
                   "request_too_large")
  chunks, size = [], 0
  try:
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise ApiError(413, f"the request body exceeds {limit} bytes", None, "request_too_large")
      chunks.append(chunk)
  except ClientDisconnect:  # the client left while sending: nothing was admitted, nobody reads the answer
    raise ApiError(499, "the client closed the connection before the request body arrived", None,
                   "client_closed") from None
  return b"".join(chunks)


class _Generation:
  """One admitted request: its queue of engine events and the response it builds from them."""

  def __init__(self, state: ServerState, prepared: protocol.Prepared, body: protocol.CompletionRequest,
               index: int = 0):
    self.state, self.prepared, self.body, self.index = state, prepared, body, index
    self.request = prepared.requests[index]
    self.rid = self.request.request_id
    tok = state.tokenizer
    self.text = TextStream(tok, self.request.prompt_ids, prepared.stop, self.request.stop_token_ids)
    self.queue: asyncio.Queue = asyncio.Queue()
    self.token_ids: list[int] = []
    self.logprobs: list[float | None] = []
    self._lp_ready = 0   # tokens whose logprobs entries may go out (logprobs_ready)
    self.cached = 0
    self.finish: str | None = None
    self.arrival = time.perf_counter()
    self.first: float | None = None
    self.last: float | None = None
    self._aloop = asyncio.get_running_loop()

  def start(self) -> None:
    self.state.live.add(self.rid)
    self.state.loop.submit(self.request, self._sink)

  def _sink(self, item) -> None:   # engine-loop thread
    self._aloop.call_soon_threadsafe(self._put, item)

  def _put(self, item) -> None:    # event loop
    if isinstance(item, Exception) or item.finish_reason is not None:
      self.state.live.discard(self.rid)
    self.queue.put_nowait(item)

  def cancel(self) -> None:
    """Asks the engine to end the request now (its slot frees); idempotent."""
    if self.rid in self.state.live:
      self.state.loop.cancel(self.rid)

  async def next_delta(self) -> tuple[str, int] | None:
    """Waits for the next event; returns `(text delta, tokens it added)`, or None once finished.

    Raises:
      ApiError: the engine refused or failed the request (400 for a GenerationError, else 500).
    """
    if self.finish is not None:
      return None
    item = await self.queue.get()
    if isinstance(item, Exception):
      self.finish = "error"
      if isinstance(item, GenerationError):
        raise bad_request(str(item), "prompt")
      raise ApiError(500, f"the engine failed this request: {type(item).__name__}: {item}", None,
                     "engine_error", type="server_error")
    event: TokenEvent = item
    self.cached = event.cached_tokens
    delta = ""
    n = 0
    if event.token_id is not None:
      now = time.perf_counter()
      self.first = self.first if self.first is not None else now
      self.last = now
      self.token_ids.append(int(event.token_id))
      self.logprobs.append(event.logprob)
      delta = self.text.add(event.token_id)
      n = 1
    if self.text.stopped and event.finish_reason is None:
      self.finish = "stop"       # a stop string: the engine is told to free the slot
      self.cancel()
    elif event.finish_reason is not None:
      self.finish = "stop" if event.finish_reason == "stop" else event.finish_reason
    if self.finish is not None:
      delta += self.text.finish()
    return delta, n

  def usage(self) -> dict:
    p, c = len(self.request.prompt_ids), len(self.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(self.cached)}}

  def logprobs_ready(self) -> int:
    """How many tokens' logprobs entries may go out now: those whose text starts before the text sent so
    far; once finished, those whose text starts before the end of the returned text (all of them unless
    a stop string cut it: the stop string's tokens and any after it are left out)."""
    spans = self.text.spans
    if self.finish is not None and not self.text.stopped:
      self._lp_ready = len(spans)
    else:   # starts are nondecreasing and the bound only grows: walk on from the last count
      bound = len(self.text.text) if self.finish is not None else self.text.sent
      while self._lp_ready < len(spans) and spans[self._lp_ready][0] < bound:
        self._lp_ready += 1
    return self._lp_ready

  def logprobs_of(self, start: int, stop: int):
    if self.body.logprobs is None:
      return None
    decoded, spans = self.text.decoded, self.text.spans[start:stop]
    return {"tokens": [decoded[a:b] for a, b in spans], "token_logprobs": list(self.logprobs[start:stop]),
            "top_logprobs": None, "text_offset": [a for a, _ in spans]}

  def choice(self, text: str, start: int, stop: int, finish: str | None, logprobs: tuple[int, int]) -> dict:
    """One choice: `text`, the ids [start, stop) as `token_ids`, the logprobs entries [logprobs[0], logprobs[1])."""
    out = {"index": 0, "text": text, "logprobs": self.logprobs_of(*logprobs), "finish_reason": finish}
    if self.body.return_token_ids:
      out["token_ids"] = self.token_ids[start:stop]
    return out

  def envelope(self, choices: list, usage: dict | None) -> dict:
    return {"id": self.rid, "object": "text_completion", "created": int(time.time()),
            "model": self.state.model_name, "choices": choices, "usage": usage}

  def record(self) -> None:
    self.state.metrics.observe_request(arrival=self.arrival, first=self.first, last=self.last,
                                       tokens=len(self.token_ids), reason=self.finish or "cancelled")


class _ChatGeneration(_Generation):
  """One choice of an admitted chat request (choice `index` of its n): its choices carry a `message`
  (or a stream's `delta`), not `text`. The response's id is the chat request's, shared by its choices."""

  def chat_choice(self, message: dict, finish: str | None, key: str, start: int = 0, stop: int | None = None) -> dict:
    out = {"index": self.index, key: message, "logprobs": None, "finish_reason": finish}
    if self.body.return_token_ids:
      out["token_ids"] = self.token_ids[start:stop]
    return out

  def envelope(self, choices: list, usage: dict | None, *, with_prompt: bool = False) -> dict:
    kind = "chat.completion.chunk" if self.body.stream else "chat.completion"
    out = {"id": self.prepared.request_id, "object": kind, "created": int(time.time()),
           "model": self.state.model_name, "choices": choices, "usage": usage}
    if with_prompt and self.body.return_token_ids:   # vLLM's field: the rendered prompt's ids
      out["prompt_token_ids"] = list(self.request.prompt_ids)
    return out


def _chat_usage(gens: list[_ChatGeneration]) -> dict:
  """The usage of a chat request's choices: the prompt once, the completions of every choice."""
  p, c = len(gens[0].request.prompt_ids), sum(len(g.token_ids) for g in gens)
  return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
          "prompt_tokens_details": {"cached_tokens": max(int(g.cached) for g in gens)}}


def _check_model(state: ServerState, name: str | None) -> None:
  if name is not None and name != state.model_name:
    raise ApiError(404, f"the model {protocol.short(name)} does not exist; this server serves {state.model_name!r}",
                   "model", "model_not_found")


def _parse(raw: bytes, schema):
  """The request body as `schema`; 400 for JSON that does not parse or does not fit it."""
  try:
    data = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
  except RecursionError:
    raise bad_request("the request body nests JSON arrays or objects too deeply", None, "invalid_json") from None
  except ValueError as e:   # an integer of more digits than Python converts (4300)
    raise bad_request(f"the request body holds a number the server cannot read: {e}", None, "invalid_json") from None
  if not isinstance(data, dict):
    raise bad_request("the request body must be a JSON object", None, "invalid_json")
  try:
    return schema.model_validate(data)
  except pydantic.ValidationError as e:
    raise protocol.from_validation_error(e) from None


def _prepare(state: ServerState, raw: bytes) -> tuple[protocol.CompletionRequest, protocol.Prepared]:
  body = _parse(raw, protocol.CompletionRequest)
  _check_model(state, body.model)
  prepared = protocol.to_engine_request(body, request_id=f"cmpl-{uuid.uuid4().hex}", tokenizer=state.tokenizer,
                                        vocab_size=state.vocab_size, max_model_len=state.max_model_len,
                                        add_bos=state.add_bos)
  return body, prepared


def _admit(state: ServerState, n: int = 1) -> None:
  """503 while draining, when the engine loop is gone, or when `n` more requests would reach max_waiting."""
  if state.draining:
    raise ApiError(503, "the server is shutting down and admits no new requests", None, "draining",
                   type="service_unavailable")
  if not state.loop.alive:
    raise ApiError(503, "the engine loop has stopped", None, "engine_stopped", type="service_unavailable")
  if n > state.max_waiting:
    raise bad_request(f"n={n} choices exceed this server's max_waiting={state.max_waiting} requests", "n")
  waiting = state.loop.num_waiting()
  if waiting + n - 1 >= state.max_waiting:
    raise ApiError(503, f"{protocol.plural(waiting, 'request')} waiting (max_waiting={state.max_waiting}); retry later",
                   None, "max_waiting", type="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _until_done_or_gone(gens: list[_Generation], request: fastapi.Request) -> list[str]:
  """The whole text of each generation of a non-streaming request (they run concurrently); cancels
  them when the client disconnects first."""
  texts: list[list[str]] = [[] for _ in gens]

  async def drain(gen, text):
    while (d := await gen.next_delta()) is not None:
      text.append(d[0])

  task = asyncio.ensure_future(asyncio.gather(*(drain(g, t) for g, t in zip(gens, texts))))
  try:
    while True:
      done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
      if done:
        task.result()
        return ["".join(t) for t in texts]
      if await request.is_disconnected():
        task.cancel()
        for gen in gens:
          gen.cancel()
        raise ApiError(499, "the client closed the connection", None, "client_closed")
  finally:
    if not task.done():
      task.cancel()


def _sse(data) -> str:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(state: ServerState) -> fastapi.FastAPI:
  """The application serving `state` (the loop must be started by the caller)."""
  app = fastapi.FastAPI(title="kda_plugin OpenAI-compatible server", docs_url=None, redoc_url=None)
  app.state.server = state

  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    return _error(e)

  @app.exception_handler(RequestValidationError)
  async def _validation(request, e: RequestValidationError):
    return _error(protocol.from_validation_error(e.errors()))

  @app.exception_handler(Exception)
  async def _internal(request, e: Exception):   # a bug: still the OpenAI error body, not a plain-text 500
    return _error(ApiError(500, f"internal server error: {type(e).__name__}: {e}", None, "internal_error",
                           type="server_error"))

  @app.exception_handler(StarletteHTTPException)
  async def _http(request, e: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return _error(ApiError(e.status_code, f"{request.method} {protocol.cut(request.url.path)}: {e.detail}", None,
                           code, type="invalid_request_error"))

  @app.get("/health")
  async def health():
    if state.draining or not state.loop.alive:
      return JSONResponse({"status": "draining" if state.draining else "engine_stopped"}, status_code=503)
    return {"status": "ok"}

  def model_card():
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kda_plugin",
            "max_model_len": state.max_model_len}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{model:path}")
  async def model(model: str):   # the openai client's models.retrieve
    _check_model(state, model)
    return model_card()

  @app.get("/metrics")
  async def metrics():
    return Response(state.metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.post("/v1/chat/completions")
  async def chat(request: fastapi.Request):
    _admit(state)
    raw = await _read_body(request, state.max_body_bytes)
    body = _parse(raw, protocol.ChatCompletionRequest)
    _check_model(state, body.model)
    if getattr(state.tokenizer, "chat_template", None) is None:
      raise ApiError(400, f"the tokenizer of {state.model_name!r} has no chat template, so chat messages cannot "
                          f"be turned into a prompt: use POST /v1/completions with a prompt", "messages",
                     "chat_template_missing")
    prepared = protocol.chat_to_engine_request(body, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                                               tokenizer=state.tokenizer, vocab_size=state.vocab_size,
                                               max_model_len=state.max_model_len)
    _admit(state, len(prepared.requests))
    gens = [_ChatGeneration(state, prepared, body, i) for i in range(len(prepared.requests))]
    for gen in gens:
      gen.start()
    if not body.stream:
      try:
        texts = await _until_done_or_gone(gens, request)
      finally:
        for gen in gens:
          if gen.finish is None:
            gen.cancel()
          gen.record()
      return gens[0].envelope([g.chat_choice({"role": "assistant", "content": t}, g.finish, "message")
                               for g, t in zip(gens, texts)], _chat_usage(gens), with_prompt=True)
    firsts = []
    try:   # each choice's first event before the headers: a refusal is still an HTTP error status
      for gen in gens:
        text, n = await gen.next_delta()
        firsts.append((text, n, gen.finish, len(gen.token_ids)))
    except BaseException:
      for gen in gens:
        gen.cancel()
        gen.record()
      raise
    return StreamingResponse(_chat_stream(gens, firsts), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    _admit(state)
    raw = await _read_body(request, state.max_body_bytes)
    body, prepared = _prepare(state, raw)
    _admit(state)
    gen = _Generation(state, prepared, body)
    gen.start()
    if not body.stream:
      try:
        text, = await _until_done_or_gone([gen], request)
      finally:
        if gen.finish is None:
          gen.cancel()
        gen.record()
      return gen.envelope([gen.choice(text, 0, len(gen.token_ids), gen.finish, (0, gen.logprobs_ready()))],
                          gen.usage())
    try:   # the first event before the headers: a refusal is still an HTTP error status
      first = await gen.next_delta()
    except BaseException:
      gen.cancel()
      gen.record()
      raise
    return StreamingResponse(_stream(gen, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  return app


async def _stream(gen: _Generation, first):
  include_usage = gen.body.stream_options is not None and gen.body.stream_options.include_usage
  try:
    delta, done, done_lp = first, 0, 0
    while delta is not None:
      text, n = delta
      if text or gen.finish is not None or (n and gen.body.return_token_ids):
        # Tokens whose text was held back (a partial stop string) go out with the next chunk that has text;
        # their logprobs entries with the chunk that sends the start of their text (or never: past a stop).
        ready = max(done_lp, gen.logprobs_ready())
        yield _sse(gen.envelope([gen.choice(text, done, len(gen.token_ids), gen.finish, (done_lp, ready))], None))
        done, done_lp = len(gen.token_ids), ready
      try:
        delta = await gen.next_delta()
      except ApiError as e:
        yield _sse(e.body())
        break
    if include_usage:
      yield _sse(gen.envelope([], gen.usage()))
    yield "data: [DONE]\n\n"
  finally:   # also when the client went away (the task is cancelled): free the slot
    if gen.finish is None:
      gen.cancel()
    gen.record()


async def _chat_stream(gens: list[_ChatGeneration], firsts: list):
  """SSE chunks of a chat's n choices, interleaved as their tokens come: per choice a role delta, content
  deltas and one chunk with finish_reason (an empty delta); then the usage chunk when asked for, then
  [DONE]. Every chunk carries one choice, named by its `index`."""
  body = gens[0].body
  include_usage = body.stream_options is not None and body.stream_options.include_usage
  merged: asyncio.Queue = asyncio.Queue()
  sent = [0] * len(gens)      # tokens of each choice whose ids went out (return_token_ids)

  # A pump may run ahead of the consumer: each delta carries the choice's finish and token count as
  # they were when it was made, not as they are when it is sent.
  async def pump(i: int, gen: _ChatGeneration):
    try:
      while (d := await gen.next_delta()) is not None:
        merged.put_nowait((i, (*d, gen.finish, len(gen.token_ids)), None))
    except ApiError as e:
      merged.put_nowait((i, None, e))
      return
    merged.put_nowait((i, None, None))

  def chunks(i: int, delta):
    gen, (text, n, finish, upto) = gens[i], delta
    if text or (n and body.return_token_ids):
      yield _sse(gen.envelope([gen.chat_choice({"content": text}, None, "delta", sent[i], upto)], None))
      sent[i] = upto
    if finish is not None:
      yield _sse(gen.envelope([gen.chat_choice({}, finish, "delta", sent[i], upto)], None))
      sent[i] = upto

  tasks = []
  try:
    for i, gen in enumerate(gens):
      yield _sse(gen.envelope([gen.chat_choice({"role": "assistant", "content": ""}, None, "delta", 0, 0)], None,
                              with_prompt=i == 0))
    for i, first in enumerate(firsts):
      for chunk in chunks(i, first):
        yield chunk
    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    running = len(gens)
    while running:
      i, delta, error = await merged.get()
      if error is not None:
        yield _sse(error.body())
        break
      if delta is None:
        running -= 1
        continue
      for chunk in chunks(i, delta):
        yield chunk
    if include_usage:
      yield _sse(gens[0].envelope([], _chat_usage(gens)))
    yield "data: [DONE]\n\n"
  finally:   # also when the client went away (the task is cancelled): free the slots
    for task in tasks:
      task.cancel()
    for gen in gens:
      if gen.finish is None:
        gen.cancel()
      gen.record()
