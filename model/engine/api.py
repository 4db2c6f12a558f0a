"""The contract between a request-level serving engine and whatever drives it (tools/serve.py).

Two engines implement `Engine`: the continuous-batching engine (`model.engine.continuous`) and the
static batcher (`model.engine.static`, the baseline the serving benchmark compares against); both are
built by `model.engine.factory.build_engine` from an `EngineConfig`. The server owns one engine and
calls it from one thread only (the engine loop); request handlers enqueue `add_request` / `cancel`.

Terms follow vLLM: `max_num_seqs` (slots: requests decoding at once), `max_model_len` (prompt + output
tokens of one request), `max_num_batched_tokens` (tokens one engine step may process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from model.engine import sampling
from model.errors import UserError


class GenerationError(UserError):
  """A generation request the engine cannot serve (empty prompt, too long, ids out of range...)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """A validated sampling configuration (see `model.engine.sampling`).

  Attributes:
    strategy: "greedy", "weighted", "topk" or "nucleus".
    temperature, top_k, top_p: as `sampling.check_sampling_args`.

  Raises:
    GenerationError: an invalid configuration (`sampling.check_sampling_args`).
  """

  strategy: str = "greedy"
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    try:
      sampling.check_sampling_args(self.strategy, self.temperature,
                                   self.top_k if self.strategy == "topk" else None,
                                   self.top_p if self.strategy == "nucleus" else None)
    except ValueError as e:
      raise GenerationError(str(e)) from None

  def row(self) -> tuple:
    """`(greedy, temperature, top_k, top_p)` of this configuration for `sampling.sample_rows`."""
    return sampling.row_params(self.strategy, self.temperature, self.top_k, self.top_p)


def check_vocab_limit(vocab_limit: int | None, vocab_size: int) -> int:
  """The ids an engine may generate: below `vocab_limit` (default `vocab_size`).

  Raises:
    GenerationError: vocab_limit outside [1, vocab_size].
  """
  limit = int(vocab_size) if vocab_limit is None else int(vocab_limit)
  if not 1 <= limit <= int(vocab_size):
    raise GenerationError(f"vocab_limit must be in [1, {vocab_size}], got {vocab_limit}")
  return limit


#: Why a request ended, as the OpenAI API spells it ("cancelled" is ours: the client went away).
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request, already tokenized and validated by the caller's schema.

  Attributes:
    request_id: unique among the engine's live requests.
    prompt_ids: token ids, 1 <= len <= max_model_len - 1.
    max_tokens: >= 1 tokens to generate at most (prompt + max_tokens <= max_model_len).
    sampling: the sampling strategy (validated on construction).
    seed: PRNG seed; the draw at output position i depends only on (seed, i) and the logits.
    stop_token_ids: generation ends after emitting one of these (reported, finish_reason "stop").
  """

  request_id: str
  prompt_ids: tuple[int, ...]
  max_tokens: int
  sampling: SamplingParams = SamplingParams()
  seed: int = 0
  stop_token_ids: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token of a request, or its end.

  Attributes:
    request_id: the request.
    token_id: the generated id, or None for an event that only ends the request (a cancellation).
    logprob: natural-log probability of `token_id` under the untempered distribution, or None.
    finish_reason: None while the request runs; else one of FINISH_REASONS.
    cached_tokens: prompt tokens whose state came from the prefix cache.
  """

  request_id: str
  token_id: int | None
  logprob: float | None
  finish_reason: str | None = None
  cached_tokens: int = 0


@dataclasses.dataclass
class EngineStats:
  """A snapshot for /metrics and tests (counters are cumulative since the engine was built)."""

  num_running: int = 0          # requests holding a slot (prefilling or decoding)
  num_waiting: int = 0          # admitted to the queue, no slot yet
  num_free_slots: int = 0
  num_compilations: int = 0     # compiled step functions so far
  prompt_tokens: int = 0        # prompt tokens of finished-prefill requests
  cached_prompt_tokens: int = 0 # of which served from the prefix cache
  generated_tokens: int = 0
  prefix_cache_bytes: int = 0   # bytes held by prefix-cache snapshots now


@runtime_checkable
class Engine(Protocol):
  """What the server needs from an engine (all calls from the one engine-loop thread)."""

  max_num_seqs: int
  max_model_len: int
  vocab_size: int

  def add_request(self, request: Request) -> None:
    """Queues a request. Raises `GenerationError` naming the field for a request
    the engine can never serve (empty prompt, ids outside the vocabulary, too long for max_model_len)."""

  def cancel(self, request_id: str) -> None:
    """Ends a waiting or running request now (its slot is free for the next step); the next `step`
    emits its TokenEvent(token_id=None, finish_reason="cancelled"). Unknown ids are ignored."""

  def step(self, emit: Callable[[TokenEvent], None]) -> None:
    """Runs one unit of work and calls `emit` for every event it produces, in order."""

  def has_unfinished(self) -> bool:
    """True while any request waits or runs."""

  def stats(self) -> EngineStats:
    """Current figures."""
