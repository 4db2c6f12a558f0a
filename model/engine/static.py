"""The static batcher behind the `Engine` API: the `Generator`, one group at a time (engine=static,
the baseline the serving benchmark compares continuous batching against).

- A group is the longest run, in arrival order, of waiting requests with the same `SamplingParams`,
  at most `max_num_seqs` requests and `max_num_batched_tokens` prompt tokens (its first request is
  always taken). A random strategy runs alone, so its draws depend only on its seed and position.
- The group is padded to `max_num_seqs` one-token dummy prompts and asks for `max_model_len -
  longest prompt` tokens, so every group compiles to the same shapes (per sampling configuration).
- The next group starts when every request of this one has ended (max_tokens, a stop token, or
  `cancel`); the rest of its decoding is abandoned.
Tokens stream as the Generator's `on_tokens` delivers them; `logprob` is None (the Generator returns
tokens only). Between decode chunks a step calls `poll` (the server's command drain), so a cancel
sent while a group runs reaches it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from model.engine.api import EngineStats, GenerationError, Request, SamplingParams, TokenEvent
from model.engine.config import EngineConfig
from model.engine.generator import Generator, round_up


class _GroupDone(Exception):
  """Raised from the Generator's callback to abandon a group whose requests have all ended."""


class _Live:
  """A request of the running group: how many tokens it has, whether it has ended."""

  __slots__ = ("request", "count", "ended")

  def __init__(self, request: Request):
    self.request, self.count, self.ended = request, 0, False


class StaticEngine:
  """`model.engine.api.Engine` over `model.engine.generator.Generator` (see the module docstring).

  Args:
    model: a `KimiLinearForCausalLM`.
    config: the sizes (`EngineConfig`, engine="static"): max_num_seqs requests per group (slots),
      max_model_len the MLA cache length per slot, max_num_batched_tokens the prompt tokens one
      group's prefill row holds (a single longer prompt still runs, alone).
    vocab_limit: only ids below it are generated; default the model's vocabulary.
    prefill_multiple: prefill rows are rounded up to this; default `max_num_batched_tokens` (one
      row length, unless a single prompt is longer).
    decode_chunk: decode steps per device call (streaming granularity).
    mesh, rules: as `Generator`.
    poll: optional zero-argument callable run between decode chunks (see the module docstring).

  Raises:
    GenerationError: vocab_limit outside [1, vocab_size].
  """

  def __init__(self, model, config: EngineConfig, *, vocab_limit: int | None = None,
               prefill_multiple: int | None = None, decode_chunk: int = 8, mesh=None, rules=None,
               poll: Callable[[], None] | None = None):
    self.max_num_seqs = config.max_num_seqs
    self.max_model_len = config.max_model_len
    self.max_num_batched_tokens = config.max_num_batched_tokens
    # eos_id None: stopping is per request (stop_token_ids), handled in the callback.
    multiple = self.max_num_batched_tokens if prefill_multiple is None else int(prefill_multiple)
    self._generator = Generator(model, max_length=self.max_model_len, eos_id=None, batch_size=self.max_num_seqs,
                                prefill_multiple=multiple, cache_multiple=multiple,
                                vocab_limit=vocab_limit, mesh=mesh, rules=rules, decode_chunk=decode_chunk)
    self.vocab_size = self._generator.vocab_size
    self.poll = poll
    self._waiting: collections.deque[Request] = collections.deque()
    self._ids: set[str] = set()          # live request ids (waiting or in the running group)
    self._group: list[_Live] = []
    self._cancelled: list[str] = []      # waiting requests cancelled: their event goes out next step
    self._stats = EngineStats(num_free_slots=self.max_num_seqs)
    self._emit: Callable[[TokenEvent], None] | None = None
    self._shapes: set = set()            # (prefill row length, sampling): one compilation each

  # --- the Engine API -----------------------------------------------------------------------------
  def add_request(self, request: Request) -> None:
    """Queues `request` (see `Engine.add_request`).

    Raises:
      GenerationError: a duplicate live request_id, an empty prompt, ids outside [0, vocab_size),
        max_tokens < 1, or prompt + max_tokens > max_model_len.
    """
    if request.request_id in self._ids:
      raise GenerationError(f"request_id {request.request_id!r} is already live")
    if int(request.max_tokens) < 1:
      raise GenerationError(f"max_tokens must be >= 1, got {request.max_tokens}")
    prompt = list(request.prompt_ids)
    if not prompt:
      raise GenerationError("prompt is empty (it has no tokens)")
    bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
    if bad:
      raise GenerationError(f"prompt holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
    if len(prompt) + int(request.max_tokens) > self.max_model_len:
      raise GenerationError(f"prompt has {len(prompt)} tokens; with max_tokens={request.max_tokens} it needs "
                            f"{len(prompt) + int(request.max_tokens)} > max_model_len={self.max_model_len}")
    self._ids.add(request.request_id)
    self._waiting.append(request)
    self._stats.num_waiting = len(self._waiting)

  def cancel(self, request_id: str) -> None:
    """Ends a waiting request (its event goes out with the next `step`) or a running one (its event
    goes out now when called from `poll` inside a step, else with the next step). Unknown ids are ignored."""
    for i, r in enumerate(self._waiting):
      if r.request_id == request_id:
        del self._waiting[i]
        self._ids.discard(request_id)
        self._cancelled.append(request_id)
        self._stats.num_waiting = len(self._waiting)
        return
    for live in self._group:
      if live.request.request_id == request_id and not live.ended:
        live.ended = True
        self._ids.discard(request_id)
        event = TokenEvent(request_id, None, None, "cancelled")
        if self._emit is not None:
          self._emit(event)
        else:
          self._cancelled.append(request_id)
        return

  def has_unfinished(self) -> bool:
    return bool(self._waiting or self._cancelled or any(not g.ended for g in self._group))

  def stats(self) -> EngineStats:
    s = self._stats
    s.num_waiting = len(self._waiting)
    s.num_running = sum(not g.ended for g in self._group)
    # A static batcher frees a group's slots only when the whole group has ended.
    s.num_free_slots = self.max_num_seqs - (len(self._group) if s.num_running else 0)
    s.num_compilations = len(self._shapes)
    return EngineStats(**vars(s))

  def step(self, emit: Callable[[TokenEvent], None]) -> None:
    """Emits pending cancellations of waiting requests, then runs the next group to its end."""
    for rid in self._cancelled:
      emit(TokenEvent(rid, None, None, "cancelled"))
    self._cancelled.clear()
    group = self._take_group()
    if not group:
      return
    self._group = [_Live(r) for r in group]
    self._emit = emit
    try:
      self._run(group, emit)
    except _GroupDone:
      pass
    finally:
      for live in self._group:   # nothing may stay open (e.g. the Generator raised)
        if not live.ended:
          live.ended = True
          self._ids.discard(live.request.request_id)
          emit(TokenEvent(live.request.request_id, None, None, "cancelled"))
      self._group = []
      self._emit = None

  # --- internals ----------------------------------------------------------------------------------
  def _take_group(self) -> list[Request]:
    if not self._waiting:
      return []
    first = self._waiting.popleft()
    group, tokens = [first], len(first.prompt_ids)
    if first.sampling.strategy == "greedy":
      # The row also holds one dummy token per unused slot (see _run): they count against the budget.
      while (self._waiting and len(group) < self.max_num_seqs and self._waiting[0].sampling == first.sampling
             and tokens + len(self._waiting[0].prompt_ids) + self.max_num_seqs - len(group) - 1
             <= self.max_num_batched_tokens):
        r = self._waiting.popleft()
        group.append(r)
        tokens += len(r.prompt_ids)
    self._stats.num_waiting = len(self._waiting)
    return group

  def _run(self, group: list[Request], emit) -> None:
    prompts = [list(r.prompt_ids) for r in group]
    prompts += [[0]] * (self.max_num_seqs - len(group))   # dummies: a fixed slot count
    budget = self.max_model_len - max(len(p) for p in prompts)
    self._shapes.add((round_up(sum(map(len, prompts)), self._generator.prefill_multiple), group[0].sampling))
    cached = 0
    self._stats.prompt_tokens += sum(len(r.prompt_ids) for r in group)

    def on_tokens(start, tokens, live):
      for j, g in enumerate(self._group):
        if g.ended or not live[j]:
          continue
        tok = int(tokens[j])
        g.count += 1
        self._stats.generated_tokens += 1
        reason = ("stop" if tok in g.request.stop_token_ids
                  else "length" if g.count >= g.request.max_tokens else None)
        if reason is not None:
          g.ended = True
          self._ids.discard(g.request.request_id)
        emit(TokenEvent(g.request.request_id, tok, None, reason, cached))
      if self.poll is not None:
        self.poll()             # may cancel requests of this group (their events go out from cancel)
      if all(g.ended for g in self._group):
        raise _GroupDone

    sampling: SamplingParams = group[0].sampling
    self._generator.generate(prompts, budget, sampling_params=sampling, seed=int(group[0].seed),
                             stop_at_eos=False, on_tokens=on_tokens)
