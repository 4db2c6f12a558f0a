"""Layers of one structure share one traced program outside training (model/nn/kimi_linear.py,
`_shared_forward` / `_shared_decode`), and sharing changes no value.

The tiny config's four layers are three kinds (KDA + dense FFN, MLA + MoE, KDA + MoE, MLA + MoE): a
prefill and a decode step each call four layer programs of which three are distinct jaxprs. The
values are compared bit for bit against the same model traced layer by layer in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import load_config
from model.nn import kimi_linear
from model.nn.kimi_linear import KimiLinearForCausalLM


def _model(*overrides):
  return KimiLinearForCausalLM(load_config(["tiny", "attention=kda_chunked", *overrides]))


def _inputs():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, 64, (2, 24)), jnp.int32)
  seg = jnp.asarray(np.repeat([[1] * 9 + [2] * 11 + [0] * 4], 2, axis=0), jnp.int32)
  return ids, seg


def _layer_calls(jaxpr, name):
  """The sub-jaxprs of every call named `name` in `jaxpr` (one level: the layer loop is unrolled)."""
  return [e.params["jaxpr"] for e in jaxpr.eqns if e.params.get("name") == name]


def _prefill_and_decode(model):
  ids, seg = _inputs()

  @jax.jit
  def run(ids, seg):
    logits, cache = model.prefill(ids, seg, num_slots=2, cache_length=32, logits_at="last")
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    step_logits, cache = model.decode(nxt, cache)
    return logits, step_logits, cache

  return run(ids, seg)


def test_layers_of_one_kind_share_one_program():
  model = _model()
  ids, seg = _inputs()
  prefill = jax.make_jaxpr(lambda i, s: model.prefill(i, s, num_slots=2, cache_length=32, logits_at="last"))(ids, seg)
  calls = _layer_calls(prefill.jaxpr, "_shared_forward")
  assert len(calls) == 4
  assert len({id(j) for j in calls}) == 3          # layers 2 and 4 (MLA + MoE) share one
  assert calls[1] is calls[3]

  _, cache = model.prefill(ids, seg, num_slots=2, cache_length=32, logits_at="last")
  decode = jax.make_jaxpr(lambda t, c: model.decode(t, c))(jnp.zeros((4,), jnp.int32), cache)
  calls = _layer_calls(decode.jaxpr, "_shared_decode")
  assert len(calls) == 4 and len({id(j) for j in calls}) == 3 and calls[1] is calls[3]


def test_a_block_recording_its_routing_is_not_shared():
  """`sow` on the module would be lost in a merged copy: such a layer traces in place, in every mode."""
  layer = _model().model.layers[1]
  assert all(_traced_share(layer, m) for m in ("eval", "prefill", "decode"))
  assert not _traced_share(layer, "train")
  layer.block_sparse_moe.record_routing = True
  assert not any(_traced_share(layer, m) for m in ("eval", "prefill", "decode", "train"))


def _traced_share(layer, mode):
  """`_shares_trace` for a traced input."""
  out = []
  jax.make_jaxpr(lambda x: out.append(kimi_linear._shares_trace(layer, mode, x)) or x)(jnp.zeros(2))
  return out[0]


def test_an_eager_call_runs_in_place():
  """Eager (untraced) calls run op by op, as before: nothing to share, and the concrete-value checks
  inside a layer still run."""
  layer = _model().model.layers[1]
  assert not any(kimi_linear._shares_trace(layer, m, jnp.zeros(2)) for m in ("eval", "prefill", "decode"))


def test_training_traces_the_layers_in_place():
  model = _model()
  ids, seg = _inputs()
  jaxpr = jax.make_jaxpr(lambda i, s: model(i, s, mode="train"))(ids, seg)
  assert not _layer_calls(jaxpr.jaxpr, "_shared_forward")


@pytest.mark.parametrize("overrides", [(), ("scan_layers=true",)], ids=["unrolled", "scan_layers"])
def test_shared_programs_change_no_value(overrides, monkeypatch):
  model = _model(*overrides)
  shared = jax.tree.leaves(_prefill_and_decode(model))
  monkeypatch.setattr(kimi_linear, "_shares_trace", lambda layer, mode, x: False)
  monkeypatch.setattr(kimi_linear.DecoderLayer, "decode", kimi_linear.DecoderLayer.decode_step)
  in_place = jax.tree.leaves(_prefill_and_decode(_model(*overrides)))
  assert len(shared) == len(in_place)
  for a, b in zip(shared, in_place):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.all(np.isfinite(np.asarray(shared[0])))


def test_the_logical_axis_rules_are_part_of_the_key():
  """A program traced under one set of rules is not reused under another."""
  model = _model()
  layer = model.model.layers[1]
  graphdef, state = nnx.split(layer)
  x = jnp.zeros((1, 8, 32), jnp.float32)
  seg = jnp.ones((1, 8), jnp.int32)
  kw = dict(mode="eval", num_slots=1, return_cache=False, cache_length=None)
  before = kimi_linear._shared_forward._cache_size()
  kimi_linear._shared_forward(graphdef, state, x, seg, None, None, rules=(("activation_batch", None),), **kw)
  kimi_linear._shared_forward(graphdef, state, x, seg, None, None, rules=(("activation_batch", "data"),), **kw)
  assert kimi_linear._shared_forward._cache_size() == before + 2
