"""Builds the engine the `engine=` key names: "continuous" (model.engine.continuous) or "static"
(model.engine.static, the static-batcher baseline)."""

from __future__ import annotations

from model.engine.continuous import ContinuousEngine
from model.engine.static import StaticEngine
from model.errors import UsageError

ENGINES = ("continuous", "static")


def check_engine(kind: str, *, prefix_cache_bytes: int = 0, prefix_cache_given: bool = False,
                 max_num_partial_prefills: int = 0) -> None:
  """Refuses keys the engine of `kind` would ignore (checked before anything loads).

  Raises:
    UsageError: an unknown kind; with engine=static, prefix_cache_bytes > 0 given explicitly (it has no
      prefix cache) or max_num_partial_prefills > 0 (it prefills whole groups); 0, the default of both,
      is accepted.
  """
  if kind not in ENGINES:
    raise UsageError(f"engine must be one of {ENGINES}, got {kind!r}")
  if kind == "static":
    if prefix_cache_given and int(prefix_cache_bytes) > 0:
      raise UsageError("engine=static has no prefix cache: drop prefix_cache_bytes (or pass prefix_cache_bytes=0), "
                       "or use engine=continuous")
    if int(max_num_partial_prefills) > 0:
      raise UsageError("engine=static prefills whole groups: drop max_num_partial_prefills (or pass 0), "
                       "or use engine=continuous")


def build_engine(kind: str, model, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 prefix_cache_bytes: int, vocab_limit: int | None, mesh=None, rules=None,
                 prefix_cache_given: bool = False, max_num_partial_prefills: int = 0):
  """The engine of `kind` over `model` with the vLLM-named sizes.

  Raises:
    UsageError: as `check_engine`.
    GenerationError: a size out of range (the engine's own check, naming the key).
  """
  check_engine(kind, prefix_cache_bytes=prefix_cache_bytes, prefix_cache_given=prefix_cache_given,
               max_num_partial_prefills=max_num_partial_prefills)
  sizes = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
               vocab_limit=vocab_limit, mesh=mesh, rules=rules)
  if kind == "static":
    return StaticEngine(model, **sizes)
  return ContinuousEngine(model, prefix_cache_bytes=int(prefix_cache_bytes),
                          max_num_partial_prefills=int(max_num_partial_prefills) or None, **sizes)
