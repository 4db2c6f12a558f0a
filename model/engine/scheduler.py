"""The continuous-batching scheduler: what each engine step computes (host side, no JAX).

Every step packs at most `max_num_batched_tokens` tokens into one row:
  1. one decode token for every running request whose prompt is done (its last generated token),
     so decoding never waits behind a long prefill;
  2. then prefill chunks of prompting requests in admission order, as much of each prompt as the
     remaining budget allows (chunked prefill: the rest runs in later steps from the state left
     in the slot). A chunk also ends at the request's next prefix-cache boundary (see
     `model.engine.prefix_cache`), so the slot can be copied right after that step.
A chunk that reaches the end of its prompt emits the request's first token; every decode token
emits the next one. The row is padded to the smallest shape bucket that holds it (`buckets`), so
the engine compiles one step function per bucket and never again.
"""

from __future__ import annotations

import dataclasses

from model.engine.api import Request

MIN_BUCKET = 16


def buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
  """Row lengths of the compiled steps: powers of two from 16 below `max_num_batched_tokens`, then
  `max_num_batched_tokens` itself (e.g. 128 -> (16, 32, 64, 128); 100 -> (16, 32, 64, 100))."""
  top = int(max_num_batched_tokens)
  out, b = [], MIN_BUCKET
  while b < top:
    out.append(b)
    b *= 2
  out.append(top)
  return tuple(out)


def bucket_for(num_tokens: int, sizes: tuple[int, ...]) -> int:
  """The smallest bucket >= num_tokens (the caller keeps num_tokens <= the largest)."""
  for b in sizes:
    if b >= num_tokens:
      return b
  raise ValueError(f"{num_tokens} tokens exceed the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class Sequence:
  """A request's progress. `slot` None while waiting; `num_computed` prompt tokens are in the
  slot's state (prefix-cache hit included); `splits` are pending snapshot boundaries (ascending)."""

  request: Request
  slot: int | None = None
  keys: list = dataclasses.field(default_factory=list)
  cached_tokens: int = 0
  num_computed: int = 0
  splits: list = dataclasses.field(default_factory=list)
  output_ids: list = dataclasses.field(default_factory=list)
  fresh: bool = True          # the slot still holds a previous request's state: reset it first

  @property
  def prompt_length(self) -> int:
    return len(self.request.prompt_ids)

  @property
  def prefilling(self) -> bool:
    return self.num_computed < self.prompt_length


@dataclasses.dataclass
class Chunk:
  """One segment of a step's row: `tokens` of `seq` fed from its slot; `emits`: this segment's last
  position samples output token number `output_index`; `snapshot_at`: the prompt length reached,
  when that is a boundary to save, else None."""

  seq: Sequence
  tokens: list
  emits: bool
  output_index: int
  snapshot_at: int | None = None


@dataclasses.dataclass
class StepPlan:
  chunks: list
  num_tokens: int
  bucket: int


def plan_step(running: list[Sequence], max_num_batched_tokens: int, sizes: tuple[int, ...], *,
              max_prefills: int | None = None, decodes_in_row: bool = True) -> StepPlan | None:
  """The next step's segments for the running sequences (in admission order), or None when there
  is nothing to compute. Requires max_num_batched_tokens >= len(running) (the engine guarantees
  it: max_num_batched_tokens >= max_num_seqs), so every decoding request gets its token.

  `max_prefills`: at most this many prompt chunks per step (None: no limit). `decodes_in_row`:
  the row (and so the bucket) holds the decode tokens too; False when the step decodes them apart
  (`model.engine.mixed_step.build_split_step`): the bucket then fits the prompt tokens alone, and
  `max_num_batched_tokens` still counts both."""
  chunks, budget = [], int(max_num_batched_tokens)
  for seq in running:
    if not seq.prefilling:
      chunks.append(Chunk(seq, [seq.output_ids[-1]], True, len(seq.output_ids)))
      budget -= 1
  num_prefills = 0
  for seq in running:
    if budget <= 0 or num_prefills == max_prefills:
      break
    if not seq.prefilling:
      continue
    num_prefills += 1
    start = seq.num_computed
    end = min(seq.prompt_length, start + budget)
    split = next((b for b in seq.splits if b > start), None)
    snapshot_at = None
    if split is not None and end >= split:
      end, snapshot_at = split, split
    chunks.append(Chunk(seq, list(seq.request.prompt_ids[start:end]), end == seq.prompt_length, 0, snapshot_at))
    budget -= end - start
  if not chunks:
    return None
  n = sum(len(c.tokens) for c in chunks)
  in_row = n if decodes_in_row else sum(len(c.tokens) for c in chunks if c.seq.prefilling)
  return StepPlan(chunks, n, bucket_for(max(in_row, 1), sizes))
