"""The continuous-batching scheduler: what each engine step computes (host side, no JAX).

Every step takes at most `max_num_batched_tokens` tokens: first one decode token per decoding
request (decoding never waits behind a long prefill), then prompt chunks in admission order with the
budget left (chunked prefill). A chunk also ends at the request's next prefix-cache boundary, so the
slot's state there can be copied. With `tails` (the split step's second stage), a chunk that ended
at a boundary goes on past it in the same step, so every token is computed once; only in steps
whose rows fit `TAIL_MAX_BUCKET`. Rows are padded to the smallest shape bucket (`buckets`): one
compiled step per bucket. The buckets are powers of two from the smallest bucket (`min_bucket`: 16,
or 128 on a TPU) up to `row_limit(config)` (the largest row the engine's sizes allow), then that
limit: ceil(log2(limit / smallest)) + 1 of them.
"""

from __future__ import annotations

import dataclasses

from model.engine.api import Request

MIN_BUCKET = 16
# The smallest bucket on a TPU: a step's row of fewer tokens costs what one of 128 costs there, the
# step being bound by reading the weights (a v5e reads 1 byte in the time of 240 FLOPs, and a bf16
# weight serves 2 FLOPs a token), so smaller buckets only add executables to compile at start-up.
TPU_MIN_BUCKET = 128
# Largest row of a step that may carry tails: the second stage must cost less than a step of its own
# (docs/performance.md).
TAIL_MAX_BUCKET = 256


def min_bucket(config, platform: str | None = None) -> int:
  """The smallest row bucket of an `EngineConfig`: its `min_bucket_tokens`, or for 0 (auto)
  `TPU_MIN_BUCKET` on a TPU (`platform`, default jax's default backend) and `MIN_BUCKET` elsewhere."""
  if config.min_bucket_tokens:
    return int(config.min_bucket_tokens)
  if platform is None:
    import jax  # noqa: PLC0415  (the scheduler is host side; only this rule asks which device runs it)
    platform = jax.default_backend()
  return TPU_MIN_BUCKET if platform == "tpu" else MIN_BUCKET


def buckets(max_num_batched_tokens: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
  """Row lengths of the compiled steps: powers of two times `smallest` below `max_num_batched_tokens`,
  then `max_num_batched_tokens` itself (e.g. 128 -> (16, 32, 64, 128); 100 -> (16, 32, 64, 100);
  1024 with smallest 128 -> (128, 256, 512, 1024); 100 with smallest 128 -> (100,))."""
  top = int(max_num_batched_tokens)
  out, b = [], int(smallest)
  while b < top:
    out.append(b)
    b *= 2
  out.append(top)
  return tuple(out)


def row_limit(config) -> int:
  """The most tokens a step's row can hold for an `EngineConfig`, the largest bucket (`buckets`):
  `max_num_batched_tokens`, capped by what the requests can fill. A request's prompt has at most
  `max_model_len - 1` tokens, so on the split route (decode_path="decode": the row holds prompt
  chunks of at most P = `num_partial_prefills` prompts) the row holds at most P * (max_model_len - 1)
  tokens, and on the mixed route (every slot's tokens in one row) S * (max_model_len - 1)
  (S = max_num_seqs). E.g. max_num_batched_tokens=2048, max_model_len=300, P=4: 1196, so buckets
  (16, 32, 64, 128, 256, 512, 1024, 1196), not 2048."""
  per_row = config.num_partial_prefills if config.decode_path == "decode" else config.max_num_seqs
  return max(1, min(int(config.max_num_batched_tokens), per_row * (int(config.max_model_len) - 1)))


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
  """One segment of a step's row: `tokens` of `seq`; `emits`: its last position (the tail's, if any)
  samples output token `output_index`; `snapshot_at` / `tail_snapshot_at`: the prompt length after
  `tokens` / after `tail` when that is a boundary to save; `tail`: prompt tokens after `snapshot_at`
  prefilled in the same step's second stage."""

  seq: Sequence
  tokens: list
  emits: bool
  output_index: int
  snapshot_at: int | None = None
  tail: list = dataclasses.field(default_factory=list)
  tail_snapshot_at: int | None = None


@dataclasses.dataclass
class StepPlan:
  """`chunks` in row order (decode tokens first); `num_tokens` all tokens of the step (tails and
  decode tokens included); `bucket` the row length; `tail_tokens` the tokens of the second stage."""

  chunks: list
  num_tokens: int
  bucket: int
  tail_tokens: int = 0


def _next_split(seq: Sequence, start: int) -> int | None:
  return next((b for b in seq.splits if b > start), None)


def plan_step(running: list[Sequence], max_num_batched_tokens: int, sizes: tuple[int, ...], *,
              max_prefills: int | None = None, decodes_in_row: bool = True,
              tails: bool = False) -> StepPlan | None:
  """The next step's segments for the running sequences (in admission order), or None when there
  is nothing to compute. Requires max_num_batched_tokens >= len(running) (`EngineConfig` checks it).

  `max_prefills`: prompt chunks per step at most (None: no limit). `decodes_in_row`: the row (and
  so the bucket) holds the decode tokens too; False for the split step, whose budget still counts
  them. `tails`: chunks that end at a boundary may go on in a second stage (split step only)."""
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
    split = _next_split(seq, start)
    snapshot_at = None
    if split is not None and end >= split:
      end, snapshot_at = split, split
    chunks.append(Chunk(seq, list(seq.request.prompt_ids[start:end]), end == seq.prompt_length, 0, snapshot_at))
    budget -= end - start
  if not chunks:
    return None
  n = sum(len(c.tokens) for c in chunks)
  in_row = n if decodes_in_row else sum(len(c.tokens) for c in chunks if c.seq.prefilling)
  n_tail = 0
  if tails and not decodes_in_row:
    for c in chunks:
      seq, start = c.seq, c.snapshot_at
      if budget <= 0:
        break
      if start is None or start >= seq.prompt_length:
        continue
      end = min(seq.prompt_length, start + budget)
      split = _next_split(seq, start)
      if split is not None and end >= split:
        end = split
      if bucket_for(max(in_row, n_tail + end - start, 1), sizes) > TAIL_MAX_BUCKET:
        continue
      c.tail = list(seq.request.prompt_ids[start:end])
      c.tail_snapshot_at = end if end == split else None
      c.emits = end == seq.prompt_length
      n_tail += end - start
      budget -= end - start
  return StepPlan(chunks, n + n_tail, bucket_for(max(in_row, n_tail, 1), sizes), n_tail)
