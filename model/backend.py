"""The interface between the host's KDA mixer and an attention backend.

The host (`model/`) never imports KDA code: the KDA mixer (`model/kda.py`) receives every
KDA-specific op from a backend object looked up by name in `model.registry`. A backend is any
object with the attributes below (duck-typed; subclassing `AttentionBackend` is optional but gives
the docstrings). Shapes follow the kda_plugin contract (../shared/docs/kda.md sections 3-4):
batch-first, `segment_ids` int32 `[B, T]` (0 = padding, label n uses slot n-1), float32 states.

Modes: "train" (needs gradients), "eval" (forward only), "prefill" (forward that also returns
states), "decode" (one token per sequence). The backend decides which op serves each mode and
reports it through `describe(mode)`.
"""

from __future__ import annotations

MODES = ("train", "eval", "prefill", "decode")


class AttentionBackend:
  """Documentation base class for attention backends (see the module docstring).

  Attributes:
    name: the registry name, e.g. "kda_reference".
  """

  name: str = "abstract"

  def describe(self, mode: str) -> str:
    """Human-readable route for `mode`, e.g. "kda_native -> kda_inference[xla]"."""
    raise NotImplementedError

  def short_conv(self, x, weight, *, segment_ids, cache, max_num_segments):
    """Depthwise causal conv with SiLU, restarting at segment starts.

    Args:
      x: `[B, T, D]` compute dtype. weight: `[W, D]`. segment_ids: int32 `[B, T]`.
      cache: float32 `[B, N, W-1, D]` per-slot windows, or None for zeros.
      max_num_segments: N (static).
    Returns:
      `(y [B, T, D] in x's dtype, final cache float32 [B, N, W-1, D])`.
    """
    raise NotImplementedError

  def short_conv_step(self, x, weight, cache):
    """One decode step: x `[S, D]`, weight `[W, D]`, cache `[S, W-1, D]` -> (y `[S, D]`, new cache)."""
    raise NotImplementedError

  def kda(self, q, k, v, g_raw, beta, *, a_log, dt_bias, lower_bound, mode, segment_ids,
          initial_state, output_final_state, max_num_segments):
    """Gate activation, q/k L2 norm and the KDA core over a packed sequence.

    Args:
      q, k: `[B, T, H, K]` after the short conv, NOT yet L2-normalised.
      v: `[B, T, H, V]`.
      g_raw: `[B, T, H, K]` raw gate input `f_b_proj(f_a_proj(x))` (not yet activated).
      beta: float32 `[B, T, H]` in [0, 1].
      a_log: float32 `[H]`; dt_bias: float32 `[H*K]`; lower_bound: None (softplus gate) or float.
      mode: "train", "eval" or "prefill".
      segment_ids: int32 `[B, T]`; initial_state: float32 `[B, N, H, K, V]` or None.
      output_final_state: return the per-slot final states.
      max_num_segments: N (static).
    Returns:
      `(o [B, T, H, V] in q's dtype, final_state float32 [B, N, H, K, V] or None)`.
    """
    raise NotImplementedError

  def kda_decode(self, q, k, v, g_raw, beta, state, *, a_log, dt_bias, lower_bound):
    """One token per sequence: q, k, g_raw `[S, H, K]`, v `[S, H, V]`, beta `[S, H]`, state float32
    `[S, H, K, V]` -> `(o [S, H, V], new_state)`; gate and L2 norm applied inside as in `kda`."""
    raise NotImplementedError
