"""kda_plugin's attention backends for the `model` host: `kda_native`, `kda_chunked`, `kda_reference`.

Each backend wraps `kda_plugin.ops` into the object interface of `model.backend.AttentionBackend`
(the host imports nothing from kda_plugin). They are published through the entry-point group
`model.attention_backends` (pyproject.toml) and by `kda_plugin.register()`.

Routing rule (which op serves which mode):

=============  ===================================  ==============================  ================
backend        train (gradients)                    eval, prefill                   decode
=============  ===================================  ==============================  ================
kda_native     kda_chunked                          kda_inference (gate + q/k L2    kda_decode_step
                                                    norm fused, raw g, a_log)
kda_chunked    kda_chunked                          kda_chunked                     kda_decode_step
kda_reference  kda_reference                        kda_reference                   kda_decode_step
=============  ===================================  ==============================  ================

Anything that needs gradients goes through `kda_chunked` (or the reference): `kda_inference` is a
forward-only op. Where the op does not fuse them, the gate (`activate_gate`: softplus, or bounded
when `lower_bound` is set) and the q/k `l2norm` are applied here first. Ops are imported lazily, at
the first call, so a backend can be looked up before every op exists.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

_SEQ_MODES = ("train", "eval", "prefill")


# Where an op lives when kda_plugin.ops does not (yet) re-export it.
_SUBMODULES = {"kda_inference": "kda_plugin.ops.inference", "kda_chunked": "kda_plugin.ops.chunked"}


def _op(name):
  fn = getattr(importlib.import_module("kda_plugin.ops"), name, None)
  if fn is None and name in _SUBMODULES:
    try:
      fn = getattr(importlib.import_module(_SUBMODULES[name]), name, None)
    except ModuleNotFoundError:
      fn = None
  if fn is None:
    raise ImportError(f"kda_plugin.ops.{name} is not available in this installation")
  return fn


class KDABackend:
  """One kda_plugin backend (see the module docstring for the routing rule).

  Attributes:
    name: registry name.
    routes: mode -> op name ("kda_inference", "kda_chunked", "kda_reference", "kda_decode_step").
    last_calls: mode -> description of the op last called (set when a model traces the op).
  """

  def __init__(self, name: str, routes: dict[str, str]):
    self.name = name
    self.routes = dict(routes)
    self.last_calls: dict[str, str] = {}

  def __repr__(self):
    return f"KDABackend({self.name!r})"

  def _op_label(self, op: str, impl: str) -> str:
    if op != "kda_inference":
      return op
    if impl == "auto":
      resolve = None
      try:
        mod = importlib.import_module(_op("kda_inference").__module__)
        resolve = getattr(mod, "resolve_backend", None)
      except ImportError:
        pass
      impl = resolve("auto") if resolve is not None else f"auto@{jax.default_backend()}"
    return f"kda_inference[{impl}]"

  def describe(self, mode: str, impl: str = "auto") -> str:
    """`"<backend> -> <op>"` for `mode` (train, eval, prefill or decode)."""
    if mode not in self.routes:
      raise ValueError(f"mode must be one of {sorted(self.routes)}, got {mode!r}")
    return f"{self.name} -> {self._op_label(self.routes[mode], impl)}"

  # --- generic KDA pieces ------------------------------------------------------------------------
  def short_conv(self, x, weight, *, segment_ids, cache, max_num_segments):
    return _op("short_conv")(x, weight, segment_ids=segment_ids, cache=cache, output_final_cache=True,
                             max_num_segments=max_num_segments, activation="silu")

  def short_conv_step(self, x, weight, cache):
    return _op("short_conv_step")(x, weight, cache, activation="silu")

  def gate(self, g_raw, a_log, dt_bias, lower_bound):
    return _op("activate_gate")(g_raw, a_log, dt_bias, lower_bound)

  def l2norm(self, x):
    # float32 out, as the fused kernel keeps its normalised q/k: rounding them back to bf16 here
    # would make the unfused routes differ from kda_native by that rounding alone.
    return _op("l2norm")(x.astype(jnp.float32))

  # --- the KDA core ------------------------------------------------------------------------------
  def kda(self, q, k, v, g_raw, beta, *, a_log, dt_bias, lower_bound, mode, segment_ids,
          initial_state, output_final_state, max_num_segments, impl="auto"):
    if mode not in _SEQ_MODES:
      raise ValueError(f"kda() serves modes {_SEQ_MODES}; use kda_decode() for decode, got {mode!r}")
    op = self.routes[mode]
    self.last_calls[mode] = self.describe(mode, impl)
    if op == "kda_inference":
      return _op("kda_inference")(
          q, k, v, g_raw, beta, segment_ids=segment_ids, initial_state=initial_state,
          output_final_state=output_final_state, a_log=a_log, dt_bias=dt_bias,
          lower_bound=lower_bound, use_qk_l2norm=True, max_num_segments=max_num_segments,
          backend=impl)
    g = self.gate(g_raw, a_log, dt_bias, lower_bound)
    o, state = _op(op)(self.l2norm(q), self.l2norm(k), v, g, beta, initial_state=initial_state,
                       output_final_state=output_final_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments)
    return o.astype(q.dtype), state

  def kda_decode(self, q, k, v, g_raw, beta, state, *, a_log, dt_bias, lower_bound, impl="auto"):
    self.last_calls["decode"] = self.describe("decode", impl)
    g = self.gate(g_raw, a_log, dt_bias, lower_bound)
    o, state = _op(self.routes["decode"])(self.l2norm(q), self.l2norm(k), v, g, beta, state)
    return o.astype(q.dtype), state


def kda_native() -> KDABackend:
  """Production backend: kda_inference for eval/prefill, kda_chunked for training, decode step."""
  return KDABackend("kda_native", {"train": "kda_chunked", "eval": "kda_inference",
                                   "prefill": "kda_inference", "decode": "kda_decode_step"})


def kda_chunked() -> KDABackend:
  """Chunked (differentiable) op in every sequence mode, decode step for decode."""
  return KDABackend("kda_chunked", {m: "kda_chunked" for m in _SEQ_MODES} | {"decode": "kda_decode_step"})


def kda_reference() -> KDABackend:
  """The token recurrence in every sequence mode (the oracle), decode step for decode."""
  return KDABackend("kda_reference", {m: "kda_reference" for m in _SEQ_MODES} | {"decode": "kda_decode_step"})


BACKENDS = {"kda_native": kda_native, "kda_chunked": kda_chunked, "kda_reference": kda_reference}
