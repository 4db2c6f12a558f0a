"""An independent NumPy float64 Kimi-Linear forward for one unpacked document.

Written from the formulas of docs/kda.md (sections 'Token recurrence', 'Gates', 'Layer') and the
layer structure of transformers' Kimi-Linear (MLA without positional encoding, sigmoid-routed MoE),
reading parameters by their paths in the model's state; the KDA recurrence is the shared float64
oracle of tests/oracles.py. It shares no code with `model/` or `kda_plugin/`.
"""

from __future__ import annotations

import numpy as np

from tests.oracles import gate_f64, kda_recurrence_f64, l2norm_f64


def flat_params(model) -> dict[str, np.ndarray]:
  """`{"model.layers.0.self_attn.q_proj.kernel": float64 array, ...}` from an NNX model."""
  from flax import nnx
  return {".".join(map(str, path)): np.asarray(v.get_value(), np.float64)
          for path, v in nnx.to_flat_state(nnx.state(model))}


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _conv(x, w):
  """Causal depthwise conv: y[t] = sum_j w[j] x[t - (W-1) + j], zeros before the start, then SiLU."""
  width = w.shape[0]
  xp = np.concatenate([np.zeros((width - 1, x.shape[1])), x], 0)
  return _silu(sum(w[j] * xp[j:j + x.shape[0]] for j in range(width)))


def kda_layer(p, pre, h, a):
  t = h.shape[0]
  nh, kd = a.kda_num_heads, a.kda_head_dim
  heads = lambda z: z.reshape(t, nh, kd)
  q = l2norm_f64(heads(_conv(h @ p[pre + "q_proj.kernel"], p[pre + "q_conv1d.kernel"])))
  k = l2norm_f64(heads(_conv(h @ p[pre + "k_proj.kernel"], p[pre + "k_conv1d.kernel"])))
  v = heads(_conv(h @ p[pre + "v_proj.kernel"], p[pre + "v_conv1d.kernel"]))
  g = gate_f64(heads(h @ p[pre + "f_a_proj.kernel"] @ p[pre + "f_b_proj.kernel"]), p[pre + "A_log"], p[pre + "dt_bias"])
  beta = _sigmoid(h @ p[pre + "b_proj.kernel"])
  o = kda_recurrence_f64(q[None], k[None], v[None], g[None], beta[None], scale=kd ** -0.5)[0][0]
  gate = heads(h @ p[pre + "g_a_proj.kernel"] @ p[pre + "g_b_proj.kernel"])
  o = _rms(o, p[pre + "o_norm.scale"], a.rms_norm_eps) * _sigmoid(gate)
  return o.reshape(t, -1) @ p[pre + "o_proj.kernel"]


def mla_layer(p, pre, h, a):
  t = h.shape[0]
  nh, dn, dr, dv, r = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
  q = (h @ p[pre + "q_proj.kernel"]).reshape(t, nh, dn + dr)
  c = h @ p[pre + "kv_a_proj_with_mqa.kernel"]
  ckv = _rms(c[:, :r], p[pre + "kv_a_layernorm.scale"], a.mla_kv_norm_eps)
  kv = (ckv @ p[pre + "kv_b_proj.kernel"]).reshape(t, nh, dn + dv)
  k = np.concatenate([kv[..., :dn], np.broadcast_to(c[:, None, r:], (t, nh, dr))], -1)
  v = kv[..., dn:]
  sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(dn + dr)
  sc = np.where(np.tril(np.ones((t, t), bool))[None], sc, -np.inf)
  pr = np.exp(sc - sc.max(-1, keepdims=True))
  pr /= pr.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", pr, v).reshape(t, -1) @ p[pre + "o_proj.kernel"]


def route(logits, bias, top_k, n_group, topk_group, norm, factor):
  """Per token: sigmoid scores, group-limited top-k of score + bias, unbiased weights renormalised."""
  s = _sigmoid(logits)
  e = s.shape[-1]
  weights = np.zeros((s.shape[0], top_k))
  idx = np.zeros((s.shape[0], top_k), np.int64)
  for n in range(s.shape[0]):
    choice = s[n] + bias
    if n_group > 1:
      groups = choice.reshape(n_group, e // n_group)
      gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
      keep = np.argsort(-gscore, kind="stable")[:topk_group]
      allowed = np.zeros(n_group, bool)
      allowed[keep] = True
      choice = np.where(np.repeat(allowed, e // n_group), choice, -np.inf)
    chosen = np.argsort(-choice, kind="stable")[:top_k]
    w = s[n, chosen]
    if norm:
      w = w / (w.sum() + 1e-20)
    weights[n], idx[n] = w * factor, chosen
  return weights, idx


def _swiglu(x, p, pre):
  return (_silu(x @ p[pre + "gate_proj.kernel"]) * (x @ p[pre + "up_proj.kernel"])) @ p[pre + "down_proj.kernel"]


def moe_layer(p, pre, h, a):
  w, idx = route(h @ p[pre + "gate.kernel"], p[pre + "gate.e_score_correction_bias"], a.num_experts_per_tok,
                 a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
  out = np.zeros_like(h)
  for n in range(h.shape[0]):
    for j in range(idx.shape[1]):
      e = idx[n, j]
      hid = _silu(h[n] @ p[pre + "experts.w1"][e]) * (h[n] @ p[pre + "experts.w3"][e])
      out[n] += w[n, j] * (hid @ p[pre + "experts.w2"][e])
  if a.num_shared_experts:
    out += _swiglu(h, p, pre + "shared_experts.")
  return out


def forward(p, a, ids):
  """Logits `[T, vocab]` (float64) of one document `ids [T]` for `ModelArgs` a."""
  x = p["model.embed_tokens.embedding"][np.asarray(ids)]
  for i, kind in enumerate(a.layer_types):
    pre = f"model.layers.{i}."
    h = _rms(x, p[pre + "input_layernorm.scale"], a.rms_norm_eps)
    x = x + (kda_layer if kind == "kda" else mla_layer)(p, pre + "self_attn.", h, a)
    h = _rms(x, p[pre + "post_attention_layernorm.scale"], a.rms_norm_eps)
    x = x + (moe_layer(p, pre + "block_sparse_moe.", h, a) if i >= a.first_k_dense_replace
             else _swiglu(h, p, pre + "mlp."))
  return _rms(x, p["model.norm.scale"], a.rms_norm_eps) @ p["lm_head.kernel"]
