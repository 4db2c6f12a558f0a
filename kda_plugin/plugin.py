"""kda_plugin's attention backends for the `model` host: `kda_native`, `kda_chunked`, `kda_reference`.

Each backend adapts `kda_plugin.ops` to the host's protocol `model.backend.AttentionBackend` (the
host imports nothing from kda_plugin). They are published through the entry-point group
`model.attention_backends` (pyproject.toml) and by `kda_plugin.register()`.

Routing rule (which op serves which mode; the modes are `model.backend.MODES`):

=============  ===================================  ==============================  ================
backend        train (gradients)                    eval, prefill                   decode
=============  ===================================  ==============================  ================
kda_native     kda_chunked (its pallas_tpu          kda_inference (gate + q/k L2    kda_decode_step
               forward on a TPU, else xla)          norm fused, raw g, a_log)
kda_chunked    kda_chunked (xla)                    kda_chunked (xla)               kda_decode_step
kda_reference  kda_reference                        kda_reference                   kda_decode_step
=============  ===================================  ==============================  ================

Anything that needs gradients goes through `kda_chunked` (or the reference): `kda_inference` is a
forward-only op. kda_native trains through `kda_chunked(implementation="pallas_tpu")` (the Mosaic
kernel's forward and a backward kernel: `kda_plugin.ops.chunked_tpu`) wherever its kernel choice
resolves to `pallas_tpu`; that op takes no initial state and returns no final state (a training
step's packed rows), and a train-mode call that passes or asks for one is refused (ValueError)
rather than served by another op. Otherwise, and always for the kda_chunked backend, training runs
the XLA chunk scan. Where the op does not fuse them, the gate (`activate_gate`: softplus, or bounded
when `lower_bound` is set) and the q/k `l2norm` are applied here first. `implementation` (the
config's `kda_implementation`) is the kernel choice of `kda_inference` ("auto" picks `pallas_tpu`,
`pallas_gpu` or `xla` by platform); the other ops have one implementation and ignore it.
The math of every op: docs/kda.md; the packing contract: docs/packing.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax.numpy as jnp

from kda_plugin._install import check_not_shadowed

check_not_shadowed()  # before the host import below: a foreign `model` package gets one clear line

from kda_plugin.ops import (activate_gate, kda_chunked as _kda_chunked, kda_decode_step, kda_inference,  # noqa: E402
                            kda_reference as _kda_reference, l2norm, short_conv, short_conv_step)
from kda_plugin.ops.inference import resolve_implementation  # noqa: E402
from model.backend import MODES, SEQUENCE_MODES  # noqa: E402

# Route name -> op. The names are what `describe` reports.
_OPS = {"kda_inference": kda_inference, "kda_chunked": _kda_chunked, "kda_reference": _kda_reference,
        "kda_decode_step": kda_decode_step}


class KDABackend:
  """One kda_plugin backend (see the module docstring for the routing rule).

  Args:
    name: registry name. routes: mode (each of `MODES`) -> op name (a key of the routing table).

  Tracing records nothing on the backend; `traced_ops()` is the explicit hook that shows which op a
  model traced (for tests and tools).
  """

  def __init__(self, name: str, routes: dict[str, str], *, train_kernel: bool = False):
    if set(routes) != set(MODES) or not set(routes.values()) <= set(_OPS):
      raise ValueError(f"routes must map each of {MODES} to one of {sorted(_OPS)}, got {routes}")
    self.name = name
    self.routes = dict(routes)
    self.train_kernel = train_kernel  # kda_chunked may take its pallas_tpu forward (module docstring)
    self._observers: list[Callable[[str, str], None]] = []

  def __repr__(self):
    return f"KDABackend({self.name!r})"

  def describe(self, mode: str, implementation: str = "auto") -> str:
    """`"<backend> -> <op>"` for `mode` (one of `model.backend.MODES`), with the kernel that
    `implementation` resolves to on this platform for `kda_inference` (e.g. `kda_inference[xla]`).

    Raises:
      ValueError: an unknown mode or implementation.
    """
    if mode not in self.routes:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    op = self.routes[mode]
    if op == "kda_inference":
      label = f"{op}[{resolve_implementation(implementation)}]"
    elif op == "kda_chunked":
      label = f"{op}[{self.chunked_implementation(implementation)}]"
    else:
      label = op
    return f"{self.name} -> {label}"

  def chunked_implementation(self, implementation: str = "auto") -> str:
    """The `kda_chunked` implementation this backend trains with: "pallas_tpu" when it may use the
    kernel (`train_kernel`) and `implementation` resolves to "pallas_tpu", else "xla"."""
    kernel = self.train_kernel and resolve_implementation(implementation) == "pallas_tpu"
    return "pallas_tpu" if kernel else "xla"

  @contextlib.contextmanager
  def traced_ops(self) -> Iterator[list[tuple[str, str]]]:
    """Collects `(mode, describe(mode, implementation))` for every op this backend traces inside
    the block (jit traces once per shape: a cached program adds nothing). A test hook; outside such
    a block tracing records nothing."""
    seen: list[tuple[str, str]] = []
    observer = lambda mode, label: seen.append((mode, label))
    self._observers.append(observer)
    try:
      yield seen
    finally:
      self._observers.remove(observer)

  def _traced(self, mode: str, implementation: str) -> None:
    if self._observers:
      label = self.describe(mode, implementation)
      for observer in list(self._observers):
        observer(mode, label)

  # --- generic KDA pieces ------------------------------------------------------------------------
  def short_conv(self, x, weight, *, segment_ids, cache, max_num_segments):
    return short_conv(x, weight, segment_ids=segment_ids, cache=cache, output_final_cache=True,
                      max_num_segments=max_num_segments, activation="silu")

  def short_conv_step(self, x, weight, cache):
    return short_conv_step(x, weight, cache, activation="silu")

  def gate(self, g_raw, a_log, dt_bias, lower_bound):
    return activate_gate(g_raw, a_log, dt_bias, lower_bound)

  def l2norm(self, x):
    # float32 out, as the fused kernel keeps its normalised q/k: rounding them back to bf16 here
    # would make the unfused routes differ from kda_native by that rounding alone.
    return l2norm(x.astype(jnp.float32))

  # --- the KDA core ------------------------------------------------------------------------------
  def kda(self, q, k, v, g_raw, beta, *, a_log, dt_bias, lower_bound, mode, segment_ids,
          initial_state, output_final_state, max_num_segments, implementation="auto", num_heads=None):
    if mode not in SEQUENCE_MODES:
      raise ValueError(f"kda() serves modes {SEQUENCE_MODES}; use kda_decode() for decode, got {mode!r}")
    op = self.routes[mode]
    self._traced(mode, implementation)
    if op == "kda_inference":  # takes the lane-dense layout itself (the TPU kernel reads it in place)
      return kda_inference(
          q, k, v, g_raw, beta, segment_ids=segment_ids, initial_state=initial_state,
          output_final_state=output_final_state, a_log=a_log, dt_bias=dt_bias,
          lower_bound=lower_bound, use_qk_l2norm=True, max_num_segments=max_num_segments,
          num_heads=num_heads, implementation=implementation)
    lane_dense = num_heads is not None
    if lane_dense and q.ndim != 3:
      raise ValueError(f"num_heads={num_heads} means lane-dense [B, T, H*K] inputs, got q of shape {q.shape}")
    if op == "kda_chunked" and self.chunked_implementation(implementation) == "pallas_tpu":
      if initial_state is not None or output_final_state:
        raise ValueError(f"{self.name} trains through kda_chunked[pallas_tpu], which takes no initial_state "
                         "and returns no final state; pass neither, or set kda_implementation=xla")
      # the kernel reads the projections' lane-dense layout in place, as in prefill
      o, state = _kda_chunked(q, k, v, g_raw, beta, segment_ids=segment_ids, max_num_segments=max_num_segments,
                              a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=True,
                              num_heads=num_heads, implementation="pallas_tpu")
      return o.astype(q.dtype), state
    if lane_dense:  # the chunked and reference ops take [B, T, H, D]
      q, k, v, g_raw = (x.reshape(x.shape[:2] + (num_heads, -1)) for x in (q, k, v, g_raw))
    if op == "kda_chunked":
      # The gate and the q/k L2 norm inside the op, per chunk: training keeps q, k and the raw gate in
      # the compute dtype for the backward pass instead of float32 activated copies (same values).
      o, state = _kda_chunked(q, k, v, g_raw, beta, initial_state=initial_state,
                              output_final_state=output_final_state, segment_ids=segment_ids,
                              max_num_segments=max_num_segments, a_log=a_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, use_qk_l2norm=True)
    else:
      g = self.gate(g_raw, a_log, dt_bias, lower_bound)
      o, state = _OPS[op](self.l2norm(q), self.l2norm(k), v, g, beta, initial_state=initial_state,
                          output_final_state=output_final_state, segment_ids=segment_ids,
                          max_num_segments=max_num_segments)
    o = o.astype(q.dtype)
    return (o.reshape(o.shape[:2] + (-1,)) if lane_dense else o), state

  def kda_decode(self, q, k, v, g_raw, beta, state, *, a_log, dt_bias, lower_bound, implementation="auto"):
    self._traced("decode", implementation)
    g = self.gate(g_raw, a_log, dt_bias, lower_bound)
    # the decode step has a TPU kernel and an XLA path (also its GPU path): the config's kernel choice
    # names which, "pallas_gpu" meaning the XLA step
    decode_impl = "xla" if implementation == "pallas_gpu" else implementation
    o, state = _OPS[self.routes["decode"]](self.l2norm(q), self.l2norm(k), v, g, beta, state,
                                           implementation=decode_impl)
    return o.astype(q.dtype), state


def kda_native() -> KDABackend:
  """Production backend: kda_inference for eval/prefill, kda_chunked for training, decode step."""
  return KDABackend("kda_native", {"train": "kda_chunked", "eval": "kda_inference",
                                   "prefill": "kda_inference", "decode": "kda_decode_step"}, train_kernel=True)


def kda_chunked() -> KDABackend:
  """Chunked (differentiable) op in every sequence mode, decode step for decode."""
  return KDABackend("kda_chunked", {m: "kda_chunked" for m in SEQUENCE_MODES} | {"decode": "kda_decode_step"})


def kda_reference() -> KDABackend:
  """The token recurrence in every sequence mode (the oracle), decode step for decode."""
  return KDABackend("kda_reference", {m: "kda_reference" for m in SEQUENCE_MODES} | {"decode": "kda_decode_step"})


BACKENDS = {"kda_native": kda_native, "kda_chunked": kda_chunked, "kda_reference": kda_reference}
