"""Input contract shared by every KDA op: shape, dtype and value checks with clear errors.

Every public op (`kda_reference`, `kda_chunked`, `kda_inference`, `kda_decode_step`) validates its
arguments here so that all paths reject the same bad inputs with the same messages. Value checks
(beta in [0, 1], g <= 0, label ranges) run only when the arrays are concrete, i.e. outside `jit`;
under tracing only static facts (shapes, dtypes) can be checked.

The packing contract (docs/packing.md section 'The contract'): `segment_ids` is int32 `[B, T]` or a rank-1
`[T]` map shared by every batch row; 0 marks padding; label n (1..N) uses state slot n - 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
  """True when `x` holds values we can read on the host (not a tracer)."""
  return x is not None and not isinstance(x, jax.core.Tracer)


def _require_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array (float32 or bfloat16), got dtype {x.dtype}")


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


@dataclasses.dataclass(frozen=True)
class KDAProblem:
  """Static description of a validated KDA call.

  Attributes:
    batch, seq_len, num_heads, key_dim, value_dim: B, T, H, K, V.
    num_segments: N (state slots) when `segment_ids` is given, else None.
    segment_ids: int32 `[B, T]` (a rank-1 map broadcast to every row), or None.
  """

  batch: int
  seq_len: int
  num_heads: int
  key_dim: int
  value_dim: int
  num_segments: int | None
  segment_ids: jax.Array | None


def check_kda_inputs(q, k, v, g, beta, *, initial_state=None, segment_ids=None,
                     max_num_segments=None, scale=None, g_is_raw: bool = False,
                     num_heads: int | None = None) -> KDAProblem:
  """Validates the arguments of a sequence-level KDA op and infers B, T, H, K, V, N.

  Args:
    q, k, g: `[B, T, H, K]` floating arrays (`g` is the log-space decay, <= 0, unless `g_is_raw`).
    v: `[B, T, H, V]` floating.
    beta: `[B, T, H]` floating, in [0, 1].
    initial_state: float `[B, N, H, K, V]` with `segment_ids`, else `[B, H, K, V]`; or None.
    segment_ids: integer `[B, T]` or `[T]`; 0 = padding, labels 1..N.
    max_num_segments: N, the number of state slots; inferred from `initial_state` or from concrete
      `segment_ids` when None.
    scale: optional positive float multiplying q.
    g_is_raw: True when `g` is a raw gate input activated inside the op (no sign check).
    num_heads: H for the lane-dense layout: q, k, g `[B, T, H*K]` and v `[B, T, H*V]` (the
      projections' output, before the split into heads); None for the `[B, T, H, D]` layout.

  Returns:
    A `KDAProblem` with the normalised `[B, T]` int32 segment map.

  Raises:
    ValueError: mismatched shapes (or a lane-dense width not divisible by num_heads), beta outside [0, 1], g > 0, labels out of range, an
      initial_state whose slot count disagrees, or N missing when it cannot be inferred.
    TypeError: integer (non-floating) q, k, v, g, beta, non-integer segment_ids, or a num_heads
      that is not an int.
  """
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if x is None:
      raise ValueError(f"{name} is required")
    _require_float(name, x)
  if num_heads is None:
    if len(_shape(q)) != 4:
      raise ValueError(f"q must have shape [B, T, H, K] (or [B, T, H*K] with num_heads), got {_shape(q)}")
    b, t, h, kd = _shape(q)
    if _shape(k) != (b, t, h, kd):
      raise ValueError(f"k must have q's shape [B, T, H, K] = {(b, t, h, kd)}, got {_shape(k)}")
    if _shape(g) != (b, t, h, kd):
      raise ValueError(f"g must have q's shape [B, T, H, K] = {(b, t, h, kd)}, got {_shape(g)}")
    if len(_shape(v)) != 4 or _shape(v)[:3] != (b, t, h):
      raise ValueError(f"v must have shape [B, T, H, V] = {(b, t, h)} + (V,), got {_shape(v)}")
    vd = _shape(v)[3]
  else:
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
      raise TypeError(f"num_heads must be a Python int (H, static), got {num_heads!r}")
    h = int(num_heads)
    if h < 1:
      raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if len(_shape(q)) != 3:
      raise ValueError(f"num_heads={h} means lane-dense inputs: q must have shape [B, T, H*K], got "
                       f"{_shape(q)} (pass num_heads=None for [B, T, H, K])")
    if _shape(q)[2] % h:
      raise ValueError(f"with num_heads={h}, q must have shape [B, T, H*K] (last dim a multiple of "
                       f"{h}), got {_shape(q)}")
    b, t, hk = _shape(q)
    kd = hk // h
    if _shape(k) != (b, t, hk):
      raise ValueError(f"k must have q's shape [B, T, H*K] = {(b, t, hk)}, got {_shape(k)}")
    if _shape(g) != (b, t, hk):
      raise ValueError(f"g must have q's shape [B, T, H*K] = {(b, t, hk)}, got {_shape(g)}")
    if len(_shape(v)) != 3 or _shape(v)[:2] != (b, t) or _shape(v)[2] % h:
      raise ValueError(f"with num_heads={h}, v must have shape [B, T, H*V] = {(b, t)} + (H*V,), "
                       f"got {_shape(v)}")
    vd = _shape(v)[2] // h
  if _shape(beta) != (b, t, h):
    raise ValueError(f"beta must have shape [B, T, H] = {(b, t, h)}, got {_shape(beta)}")
  if min(b, t, h, kd, vd) < 1:
    raise ValueError(f"every dimension must be >= 1, got q {_shape(q)} and v {_shape(v)}")
  if scale is not None and is_concrete(scale) and not float(scale) > 0:
    raise ValueError(f"scale must be a positive number, got {scale}")

  if is_concrete(beta):
    bb = np.asarray(beta, dtype=np.float32)
    if not np.all((bb >= 0) & (bb <= 1)):
      bad = bb[~((bb >= 0) & (bb <= 1))]
      raise ValueError(f"beta must lie in [0, 1]; found {bad.size} values outside, e.g. {bad.flat[0]}")
  if not g_is_raw and is_concrete(g):
    gg = np.asarray(g, dtype=np.float32)
    if not np.all(gg <= 0):
      bad = gg[~(gg <= 0)]
      raise ValueError(
          f"g is the log-space decay and must be <= 0 (use a gate activation such as "
          f"kda_gate_softplus); found {bad.size} values > 0 or NaN, e.g. {bad.flat[0]}")

  n = None
  seg = None
  if segment_ids is not None:
    seg_shape = _shape(segment_ids)
    if not jnp.issubdtype(segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype, jnp.integer):
      raise TypeError(f"segment_ids must be an integer array, got dtype {np.asarray(segment_ids).dtype if not hasattr(segment_ids, 'dtype') else segment_ids.dtype}")
    if seg_shape not in ((b, t), (t,)):
      raise ValueError(f"segment_ids must have shape [B, T] = {(b, t)} or [T] = {(t,)}, got {seg_shape}")
    seg = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
    if max_num_segments is not None:
      n = int(max_num_segments)
      if n < 1:
        raise ValueError(f"max_num_segments must be >= 1, got {max_num_segments}")
    elif initial_state is not None:
      if len(_shape(initial_state)) != 5:
        raise ValueError(
            f"with segment_ids, initial_state must have shape [B, N, H, K, V], got {_shape(initial_state)}")
      n = _shape(initial_state)[1]
    elif is_concrete(segment_ids):
      n = max(1, int(np.max(np.asarray(segment_ids))) if np.size(segment_ids) else 1)
    else:
      raise ValueError(
          "max_num_segments (N) is required when segment_ids is traced (under jit) and no "
          "initial_state gives the slot count; pass max_num_segments=N as a static argument")
    if is_concrete(segment_ids):
      ids = np.asarray(segment_ids)
      if ids.size and ids.min() < 0:
        raise ValueError(f"segment_ids must be >= 0 (0 = padding), found label {ids.min()}")
      check_contiguous_runs(ids)
      if ids.size and ids.max() > n:
        raise ValueError(
            f"segment_ids label {ids.max()} exceeds max_num_segments={n} (label n uses state slot n-1)")
    if initial_state is not None:
      want = (b, n, h, kd, vd)
      if _shape(initial_state) != want:
        if len(_shape(initial_state)) == 5 and _shape(initial_state)[1] != n:
          raise ValueError(
              f"initial_state has {_shape(initial_state)[1]} state slots but max_num_segments is {n}; "
              f"expected shape [B, N, H, K, V] = {want}")
        raise ValueError(f"initial_state must have shape [B, N, H, K, V] = {want}, got {_shape(initial_state)}")
  else:
    if max_num_segments is not None:
      raise ValueError("max_num_segments is only meaningful together with segment_ids")
    if initial_state is not None and _shape(initial_state) != (b, h, kd, vd):
      raise ValueError(f"initial_state must have shape [B, H, K, V] = {(b, h, kd, vd)}, got {_shape(initial_state)}")
  if initial_state is not None:
    _require_float("initial_state", initial_state)
  return KDAProblem(b, t, h, kd, vd, n, seg)


def check_contiguous_runs(ids: np.ndarray) -> None:
  """Raises ValueError when a label occurs in two separate runs of one row (documents are contiguous)."""
  rows = ids.reshape(-1, ids.shape[-1]) if ids.ndim else ids.reshape(1, 1)
  for r, row in enumerate(rows):
    starts = np.concatenate([[True], row[1:] != row[:-1]]) & (row != 0)
    labels = row[starts]
    if labels.size != np.unique(labels).size:
      dup = labels[np.argmax([np.sum(labels == x) > 1 for x in labels])]
      raise ValueError(
          f"segment_ids row {r}: label {dup} appears in more than one run; each document must be one "
          "contiguous run of its label (padding 0 may only separate different labels)")


def default_scale(scale, key_dim: int) -> float:
  """The query scale: `scale` if given, else K**-0.5 (as in fla and transformers)."""
  return float(key_dim) ** -0.5 if scale is None else scale


def check_gate_args(g_is_raw: bool, a_log, dt_bias, lower_bound, num_heads: int, key_dim: int):
  """Validates the in-kernel gate's parameters; returns `lower_bound` as a checked float (or None).

  Raises:
    ValueError: dt_bias or lower_bound without a_log (a raw g input), lower_bound outside [-5, 0)
      (`gates.check_lower_bound`), a_log without H values, dt_bias without H*K values.
  """
  if not g_is_raw:
    if dt_bias is not None or lower_bound is not None:
      raise ValueError("dt_bias and lower_bound are gate parameters: they need a_log (raw g input)")
    return None
  if lower_bound is not None:
    lower_bound = check_lower_bound(lower_bound)
  if np.size(a_log) != num_heads:
    raise ValueError(f"a_log must have H={num_heads} values (shape [H]), got shape {np.shape(a_log)}")
  if dt_bias is not None and np.size(dt_bias) != num_heads * key_dim:
    raise ValueError(f"dt_bias must have H*K={num_heads * key_dim} values (shape [H*K] or [H, K]), "
                     f"got shape {np.shape(dt_bias)}")
  return lower_bound


@dataclasses.dataclass(frozen=True)
class InferenceCall:
  """One `kda_inference` call after its single validation (`check_kda_inputs`, `check_gate_args`):
  what every implementation of the dispatch table receives.

  Attributes:
    problem: the validated `KDAProblem` (B, T, H, K, V, N).
    q, k, v, g, beta: as passed: `[B, T, H, D]`, or lane-dense `[B, T, H*D]` when `lane_dense`.
    segment_ids: as passed (`[B, T]` or a shared `[T]`), or None.
    initial_state: as passed, or None. output_final_state: bool.
    scale: as passed (None: K**-0.5). a_log, dt_bias: as passed (a_log None: g is the log decay).
    lower_bound: the checked bound of the bounded gate, or None. use_qk_l2norm: bool.
    lane_dense: q, k, v, g come as `[B, T, H*D]` (`num_heads` was given).
    interpret: the caller's `interpret` (Pallas kernels only).
  """

  problem: KDAProblem
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array
  segment_ids: jax.Array | None
  initial_state: jax.Array | None
  output_final_state: bool
  scale: float | None
  a_log: jax.Array | None
  dt_bias: jax.Array | None
  lower_bound: float | None
  use_qk_l2norm: bool
  lane_dense: bool
  interpret: object

  @property
  def packed(self) -> bool:
    return self.segment_ids is not None

  @property
  def num_slots(self) -> int:
    """State slots of the kernels: N with segment_ids, else 1 (one document per row)."""
    return self.problem.num_segments if self.packed else 1

  def split_heads(self, x):
    """`[B, T, H*D] -> [B, T, H, D]` for a lane-dense call (a free reshape), else x."""
    return x.reshape(*x.shape[:2], self.problem.num_heads, -1) if self.lane_dense else x

  def kernel_scale(self) -> float:
    """The query scale as the static float a Pallas kernel is specialised on."""
    if self.scale is not None and not is_concrete(self.scale):
      raise ValueError("scale must be a static Python float for the Pallas kernels, not a traced value")
    return float(default_scale(self.scale, self.problem.key_dim))

  def kernel_gate(self):
    """`(a_log [H], dt_bias [H, K])` float32 for the in-kernel gate (dt_bias zeros when None), or None."""
    if self.a_log is None:
      return None
    h, kd = self.problem.num_heads, self.problem.key_dim
    a_log = jnp.asarray(self.a_log, jnp.float32).reshape(h)
    dt_bias = (jnp.zeros((h, kd), jnp.float32) if self.dt_bias is None
               else jnp.asarray(self.dt_bias, jnp.float32).reshape(h, kd))
    return a_log, dt_bias

  def slot_states(self):
    """initial_state with a slot axis (`[B, 1, H, K, V]` for an unpacked call), or None."""
    h0 = self.initial_state
    if h0 is not None and not self.packed:
      h0 = jnp.asarray(h0)[:, None]
    return h0

  def kernel_segment_ids(self):
    """int32 `[1, T]` for a shared `[T]` map (every row's grid steps read the same labels), the
    normalised `[B, T]` map, or None."""
    if not self.packed:
      return None
    if np.ndim(self.segment_ids) == 1:
      return jnp.asarray(self.segment_ids, jnp.int32)[None]
    return self.problem.segment_ids

  def unslot_final(self, o, final):
    """`(o, final)` as the caller's layout asks: final None unless requested, without the slot axis
    of an unpacked call."""
    if not self.output_final_state:
      return o, None
    return o, (final if self.packed else final[:, 0])


LOWER_BOUND_RANGE = (-5.0, 0.0)  # the bounded gate's lower_bound: a negative bound on the log decay


def check_lower_bound(lower_bound) -> float:
  """Returns `lower_bound` as a float after checking `-5 <= lower_bound < 0` (ValueError otherwise)."""
  if not is_concrete(lower_bound):
    raise ValueError("lower_bound must be a static Python float in [-5, 0), not a traced value")
  lb = float(np.asarray(lower_bound))
  lo, hi = LOWER_BOUND_RANGE
  if not (lo <= lb < hi):
    raise ValueError(f"lower_bound must lie in [{lo:g}, {hi:g}) (a negative bound on the log decay), got {lb}")
  return lb
