"""`EngineConfig`: the serving sizes of an engine (vLLM's names), validated once, on construction;
the engines, the model runner and the factory take it as it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from model.errors import UsageError

ENGINES = ("continuous", "static")
DECODE_PATHS = ("decode", "mixed")
DEFAULT_PARTIAL_PREFILLS = 4   # max_num_partial_prefills=0 means min(this, max_num_seqs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """The sizes of a serving engine.

  Attributes:
    max_num_seqs: S, requests holding a slot at once (>= 1).
    max_model_len: prompt + output tokens of one request (>= 2); the MLA latent rows per slot.
    max_num_batched_tokens: tokens one step may process (continuous: >= max_num_seqs, so every
      decoding request gets its token; static: the prompt tokens of one group's row).
    engine: "continuous" or "static" (the benchmark's baseline).
    max_num_partial_prefills: P, prompts prefilled in one continuous step, in [1, max_num_seqs];
      0 = min(4, max_num_seqs). static: 0 only.
    prefix_cache_bytes: the continuous engine's prefix-cache budget; 0 = off (static: 0 only).
    decode_path: "decode" (split steps) or "mixed" (one packed row); continuous only.
    min_bucket_tokens: the smallest row bucket the continuous engine compiles a step for (>= 0); 0 =
      auto: 128 on a TPU (a smaller row costs as much there: the step reads the weights either
      way), 16 elsewhere (`scheduler.min_bucket`).

  Raises:
    UsageError: a value out of range or a key the engine would ignore; the message names the key.
  """

  max_num_seqs: int
  max_model_len: int
  max_num_batched_tokens: int
  engine: str = "continuous"
  max_num_partial_prefills: int = 0
  prefix_cache_bytes: int = 0
  decode_path: str = "decode"
  min_bucket_tokens: int = 0

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise UsageError(f"engine must be one of {ENGINES}, got {self.engine!r}")
    for key, low in (("max_num_seqs", 1), ("max_model_len", 2), ("max_num_batched_tokens", 1),
                     ("prefix_cache_bytes", 0), ("max_num_partial_prefills", None), ("min_bucket_tokens", 0)):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{key} must be an integer, got {v!r}")
      if low is not None and v < low:
        raise UsageError(f"{key} must be >= {low}, got {v}")
    if self.decode_path not in DECODE_PATHS:
      raise UsageError(f"decode_path must be 'decode' or 'mixed', got {self.decode_path!r}")
    if self.engine == "static":
      if self.prefix_cache_bytes > 0:
        raise UsageError("engine=static has no prefix cache: drop prefix_cache_bytes (or pass prefix_cache_bytes=0), "
                         "or use engine=continuous")
      if self.max_num_partial_prefills != 0:
        raise UsageError("engine=static prefills whole groups: drop max_num_partial_prefills (or pass 0), "
                         "or use engine=continuous")
      if self.min_bucket_tokens != 0:
        raise UsageError("engine=static compiles one prefill row of max_num_batched_tokens: drop min_bucket_tokens "
                         "(or pass 0), or use engine=continuous")
      return
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise UsageError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                       f"{self.max_num_seqs} (every decoding request needs one token per step)")
    if not 0 <= self.max_num_partial_prefills <= self.max_num_seqs:
      raise UsageError(f"max_num_partial_prefills must be in [1, max_num_seqs={self.max_num_seqs}] (0 = min("
                       f"{DEFAULT_PARTIAL_PREFILLS}, max_num_seqs)), got {self.max_num_partial_prefills}")

  @property
  def num_partial_prefills(self) -> int:
    """P as the continuous engine runs it (`max_num_partial_prefills`, its 0 resolved)."""
    return self.max_num_partial_prefills or min(DEFAULT_PARTIAL_PREFILLS, self.max_num_seqs)

  @classmethod
  def from_config(cls, cfg, given: Iterable[str] = ()) -> EngineConfig:
    """The engine keys of a tool's config. `given`: the keys the user typed; engine=static ignores
    prefix_cache_bytes at its default (the continuous engine's budget) and refuses it given > 0.

    Raises:
      UsageError: as the class.
    """
    static = cfg.engine == "static"
    return cls(engine=cfg.engine, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
               max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_partial_prefills=cfg.max_num_partial_prefills,
               min_bucket_tokens=cfg.min_bucket_tokens,
               prefix_cache_bytes=0 if static and "prefix_cache_bytes" not in set(given) else cfg.prefix_cache_bytes)
