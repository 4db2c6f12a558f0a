"""The contract between the host's KDA mixer and an attention backend: `AttentionBackend`.

The host (`model/`) never imports KDA code: the KDA mixer (`model/nn/kda.py`) receives every
KDA-specific op from a backend object looked up by name (`config.attention`) in `model.registry`,
which checks it against this protocol (`check_backend`) before handing it out. Shapes follow the
packing contract (docs/packing.md): batch-first, `segment_ids` int32 `[B, T]` (0 = padding, label n
uses slot n-1), float32 states. The math of each op: docs/kda.md.

Words: a *backend* is a registry entry (`kda_native`, ...); its *implementation* is the kernel
choice inside one op (`config.kda_implementation`, e.g. "auto", "xla", "pallas_tpu"), passed
through to the backend and ignored by backends that have only one.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

# The modes a model runs in; defined here only. "train" needs gradients, "eval" is a forward only,
# "prefill" a forward that also returns states, "decode" one token per sequence.
MODES = ("train", "eval", "prefill", "decode")
SEQUENCE_MODES = ("train", "eval", "prefill")  # the modes `kda` serves (decode is `kda_decode`)


@runtime_checkable
class AttentionBackend(Protocol):
  """What the KDA mixer calls. Any object with these members is a backend (no subclassing needed).

  Attributes:
    name: the registry name, e.g. "kda_reference".
  """

  name: str

  def describe(self, mode: str, implementation: str = "auto") -> str:
    """The op that serves `mode` (one of `MODES`), e.g. "kda_native -> kda_inference[xla]".

    Pure: it reports the routing rule and records nothing. Raises ValueError for an unknown mode.
    """
    ...

  def short_conv(self, x, weight, *, segment_ids, cache, max_num_segments) -> tuple[Any, Any]:
    """Depthwise causal conv with SiLU, restarting at segment starts.

    Args:
      x: `[B, T, D]` compute dtype. weight: `[W, D]`. segment_ids: int32 `[B, T]`.
      cache: float32 `[B, N, W-1, D]` per-slot windows, or None for zeros.
      max_num_segments: N (static).
    Returns:
      `(y [B, T, D] in x's dtype, final cache float32 [B, N, W-1, D])`.
    """
    ...

  def short_conv_step(self, x, weight, cache) -> tuple[Any, Any]:
    """One decode step: x `[S, D]`, weight `[W, D]`, cache `[S, W-1, D]` -> (y `[S, D]`, new cache)."""
    ...

  def kda(self, q, k, v, g_raw, beta, *, a_log, dt_bias, lower_bound, mode, segment_ids, initial_state,
          output_final_state, max_num_segments, implementation="auto", num_heads=None) -> tuple[Any, Any]:
    """Gate activation, q/k L2 norm and the KDA core over a packed sequence (docs/kda.md).

    Args:
      q, k: `[B, T, H, K]` after the short conv, NOT yet L2-normalised; or lane-dense `[B, T, H*K]`
        (head h in lanes h*K..(h+1)*K-1, the layout of the mixer's projections) when `num_heads=H`.
      v: `[B, T, H, V]` (lane-dense: `[B, T, H*V]`).
      g_raw: like q: raw gate input `f_b_proj(f_a_proj(x))` (not yet activated).
      beta: float32 `[B, T, H]` in [0, 1].
      a_log: float32 `[H]`; dt_bias: float32 `[H*K]`; lower_bound: None (softplus gate) or float.
      mode: one of `SEQUENCE_MODES`.
      segment_ids: int32 `[B, T]`; initial_state: float32 `[B, N, H, K, V]` or None.
      output_final_state: return the per-slot final states.
      max_num_segments: N (static).
      implementation: the kernel choice of the op serving `mode` (`config.kda_implementation`).
      num_heads: H when q, k, v, g_raw come lane-dense (3-D), else None. The KDA mixer always passes
        lane-dense inputs: a backend serves them without a relayout where its kernel can.
    Returns:
      `(o in q's layout ([B, T, H, V], or [B, T, H*V] lane-dense) and dtype,
      final_state float32 [B, N, H, K, V] or None)`.
    """
    ...

  def kda_decode(self, q, k, v, g_raw, beta, state, *, a_log, dt_bias, lower_bound,
                 implementation="auto") -> tuple[Any, Any]:
    """One token per sequence: q, k, g_raw `[S, H, K]`, v `[S, H, V]`, beta `[S, H]`, state float32
    `[S, H, K, V]` -> `(o [S, H, V], new_state)`; gate and L2 norm applied inside as in `kda`."""
    ...


_METHODS = ("describe", "short_conv", "short_conv_step", "kda", "kda_decode")


def _parameters(fn) -> set[str]:
  return {p.name for p in inspect.signature(fn).parameters.values()
          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}


def _takes_any_keyword(fn) -> bool:
  return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def check_backend(obj, name: str) -> None:
  """Checks that `obj` has every member of `AttentionBackend` and that each method accepts the
  protocol's parameters (by name; a `**kwargs` method accepts any keyword).

  Raises:
    TypeError: naming the backend, the missing members or the method and its missing parameters.
  """
  missing = [m for m in ("name",) + _METHODS if not hasattr(obj, m)]
  if missing:
    raise TypeError(f"attention backend {name!r} ({obj!r}) is not a model.backend.AttentionBackend: it lacks "
                    f"{', '.join(missing)}")
  for method in _METHODS:
    want = _parameters(getattr(AttentionBackend, method))
    fn = getattr(obj, method)
    if _takes_any_keyword(fn):
      continue
    lacking = sorted(want - _parameters(fn))
    if lacking:
      raise TypeError(f"attention backend {name!r}: {method}() does not take {', '.join(lacking)} (the "
                      f"signature of model.backend.AttentionBackend.{method})")
