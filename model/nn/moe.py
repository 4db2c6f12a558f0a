"""Mixture of experts of Kimi-Linear: sigmoid router with correction bias, stacked SwiGLU experts,
shared experts.

Routing (DeepSeek-V3 style, as transformers `KimiLinearTopkRouter`; names in docs/checkpoints.md):
`s = sigmoid(x @ W_gate)` in float32; experts are chosen by top-k of `s + e_score_correction_bias`
(optionally limited to the `topk_group` best of `n_group` groups, a group scored by the sum of its
two best biased scores); the weights are the *unbiased* `s` of the chosen experts, renormalised to
sum 1 (`norm_topk_prob`, denominator + 1e-20) and multiplied by `routed_scaling_factor`.
Output = sum_k weight_k * expert_k(x) + shared_experts(x).

Experts are stacked (`experts.w1 [E, d, I]`, ...; the HF names: docs/checkpoints.md). The correction
bias is a float32 `RouterBias`, not an `nnx.Param`: load balancing adjusts it, gradients and weight
decay never do.

Auxiliary-loss-free load balancing (DeepSeek-V3 report, arXiv:2412.19437, sec. 2.1.2; Kimi-Linear
trains its router the same way): after each optimizer step the bias of expert i moves by
`rate * sign(mean_j load_j - load_i)`, where `load_i` counts the (non-padding token, choice) pairs the
step routed to expert i (top-k of the biased scores, as above). `expert_load` and `balanced_bias`
compute it; a block records its choices (`record_routing`, an `nnx.Intermediate` named
`routed_experts`) only when the training step asks for them (model/training/steps.py).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from model.nn.layers import SwiGLU, as_dtype, param

GMM_ROWS = 128  # megablox's smallest row tile: the sorted (token, expert) rows are padded to a multiple of it
GMM_LONG_ROWS, GMM_LONG_TM = 8192, 256   # at least this many rows (prefill): 256-row tiles
# Megablox double-buffers its three blocks and keeps a float32 accumulator in VMEM; it asks for no
# more than the default scoped VMEM (16 MiB on v5e), so a tiling must stay under it. 14 MiB leaves
# Mosaic its own scratch.
GMM_VMEM_BUDGET = 14 * 2**20


def gmm_vmem_bytes(tm: int, tk: int, tn: int, itemsize: int = 2) -> int:
  """VMEM of megablox's `gmm` at one tiling: lhs [tm, tk], rhs [tk, tn] and out [tm, tn] double-buffered
  in the operands' dtype, the float32 accumulator [tm, tn]."""
  return 2 * (tm * tk + tk * tn + tm * tn) * itemsize + tm * tn * 4


def tgmm_vmem_bytes(tm: int, tk: int, tn: int, itemsize: int = 2) -> int:
  """VMEM of megablox's `tgmm` (the weight gradient, `[k, m] x [m, n]` per group) at one tiling: lhs
  [tk, tm], rhs [tm, tn] and out [tk, tn] double-buffered, the float32 accumulator [tk, tn]."""
  return 2 * (tk * tm + tm * tn + tk * tn) * itemsize + tk * tn * 4


def _dividing_tiles(x: int) -> list[int]:
  """Multiples of 128 that divide `x`, largest first; [128] when there is none (megablox masks the
  ragged last tile, e.g. the demo's 64-wide experts)."""
  return [t for t in range(x - x % 128, 127, -128) if x % t == 0] or [128]


def _largest_tiles(m: int, k: int, n: int, itemsize: int, vmem) -> tuple[int, int, int]:
  tm = GMM_LONG_TM if m >= GMM_LONG_ROWS and m % GMM_LONG_TM == 0 else GMM_ROWS
  fits = [(tk * tn, tk, tn) for tk in _dividing_tiles(k) for tn in _dividing_tiles(n)
          if vmem(tm, tk, tn, itemsize) <= GMM_VMEM_BUDGET]
  _, tk, tn = max(fits) if fits else (0, 128, 128)
  return tm, tk, tn


def gmm_tiling(m: int, k: int, n: int, itemsize: int = 2) -> tuple[int, int, int]:
  """Megablox `gmm`'s `(tm, tk, tn)` for `[m, k]` rows times one expert's `[k, n]` weight, both of
  `itemsize` bytes an element.

  tm: `GMM_LONG_TM` from `GMM_LONG_ROWS` rows (prefill), else `GMM_ROWS`; `m` is padded to it.
  tk, tn: the largest tile of the weight that fits `GMM_VMEM_BUDGET` (the whole expert matrix when it
  fits), each a multiple of 128 dividing its dimension; a larger tk wins a tie. Each grid step of the
  kernel costs a fixed overhead on the TPU, so fewer, larger steps are faster: on the v5e, whole-matrix
  tiles halved the real-width shard's grouped matmuls against 256 x 256 tiles, in prefill and in decode
  (docs/performance.md, "The MoE's grouped matmuls on the chip")."""
  return _largest_tiles(m, k, n, itemsize, gmm_vmem_bytes)


def tgmm_tiling(m: int, k: int, n: int, itemsize: int = 2) -> tuple[int, int, int]:
  """Megablox `tgmm`'s `(tm, tk, tn)` for the weight gradient `[k, m] x [m, n]` of each group: as
  `gmm_tiling`, within `tgmm_vmem_bytes` (its accumulator is [tk, tn], so whole-matrix tiles that fit
  a forward `gmm` need not fit it)."""
  return _largest_tiles(m, k, n, itemsize, tgmm_vmem_bytes)


def _megablox_kernels():
  """jax's megablox kernel module (its `gmm` and `tgmm` Pallas calls, without megablox's VJP). The
  package exports the differentiable `gmm` under the module's name, so the module comes from
  sys.modules; imported only when megablox runs (a TPU kernel)."""
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul(lhs, rhs, group_sizes, out_dtype, interpret: bool = False):
  """Megablox's grouped matmul with tiles chosen for each of its three kernels.

  lhs `[m, k]` (rows sorted by group, m a multiple of the row tile), rhs `[E, k, n]`, group_sizes int32
  `[E]` summing to m -> `[m, n]` in `out_dtype`. Megablox's own VJP runs its backward kernels with the
  forward's tiling, which need not fit their VMEM (`tgmm_vmem_bytes`); this one gives each its own.
  `interpret`: Pallas interpret mode (tests on a CPU)."""
  backend = _megablox_kernels()
  (m, k), n = lhs.shape, rhs.shape[2]
  tiling = gmm_tiling(m, k, n, jnp.dtype(lhs.dtype).itemsize)
  return backend.gmm(lhs, rhs, group_sizes, out_dtype, tiling, None, None, False, interpret)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, out_dtype, interpret):
  return grouped_matmul(lhs, rhs, group_sizes, out_dtype, interpret), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(out_dtype, interpret, residual, grad):
  backend = _megablox_kernels()
  lhs, rhs, group_sizes = residual
  (m, k), n = lhs.shape, rhs.shape[2]
  size = jnp.dtype(lhs.dtype).itemsize
  grad = grad.astype(lhs.dtype)
  # d lhs [m, k] = grad [m, n] x rhs[g]^T: a gmm of problem (m, n, k) reading rhs transposed
  grad_lhs = backend.gmm(grad, rhs, group_sizes, lhs.dtype, gmm_tiling(m, n, k, size), None, None, True, interpret)
  # d rhs [E, k, n] = lhs^T [k, m] x grad [m, n], per group
  grad_rhs = backend.tgmm(lhs.swapaxes(0, 1), grad, group_sizes, rhs.dtype, tgmm_tiling(m, k, n, size), None,
                          rhs.shape[0], None, interpret)
  return grad_lhs, grad_rhs, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def target_platform() -> str:
  """The platform being traced for: the abstract mesh's device under an ahead-of-time compile, else
  `jax.default_backend()` ("tpu", "gpu", "cpu", ...)."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_moe_impl(impl: str) -> str:
  """The expert implementation `impl` ("auto" included) runs as: "dense", "ragged" or "megablox".

  "auto" is "megablox" on a TPU when the experts are not split over a mesh (one device, or no mesh:
  the Pallas kernel runs on whole arrays; GSPMD cannot split it), and "dense" otherwise. Not
  "ragged": XLA expands `jax.lax.ragged_dot` into every group for every row on TPU (an
  [E, N*k, I] convolution, k times dense's work; docs/performance.md), and on CPU / GPU dense keeps
  each token's arithmetic independent of the batch it shares.
  """
  if impl != "auto":
    return impl
  mesh = jax.sharding.get_abstract_mesh()
  whole = mesh is None or mesh.empty or mesh.size == 1
  return "megablox" if target_platform() == "tpu" and whole else "dense"


@jax.custom_vjp
def combine_choices(weights, y):
  """`sum_k weights[n, k] * y[n, k, :]` in float32: float32 `weights [N, k]`, `y [N, k, d]` in the
  compute dtype -> float32 `[N, d]`.

  The backward pass keeps `y` in its own dtype (autodiff of the float32 product would keep a float32
  copy of it, `[N*k, d]`, per MoE layer); its gradients are those of the float32 product.
  """
  return jnp.sum(weights[..., None] * y.astype(jnp.float32), axis=1)


def _combine_fwd(weights, y):
  return combine_choices(weights, y), (weights, y)


def _combine_bwd(res, g):
  weights, y = res
  dw = jnp.sum(g[:, None, :] * y.astype(jnp.float32), axis=-1)
  dy = (weights[..., None] * g[:, None, :]).astype(y.dtype)
  return dw, dy


combine_choices.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x, order, inverse, k: int):
  """Each token's `k` copies, sorted by expert: `x [N, d]` -> `[N*k, d]`, row r = `x[order[r] // k]`.

  `order` int `[N*k]` is the stable argsort of the flattened `[N, k]` expert choices and `inverse` its
  inverse permutation. The backward gathers (`d x[t] = sum_j d rows[inverse[t*k + j]]`, summed in
  float32) where autodiff of the gather would scatter-add `N*k` rows into `N` with repeated indices.
  """
  return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
  return dispatch_rows(x, order, inverse, k), (order, inverse)


def _dispatch_bwd(k, res, g):
  order, inverse = res
  n = inverse.shape[0] // k
  dx = jnp.sum(g[inverse].reshape(n, k, -1).astype(jnp.float32), axis=1).astype(g.dtype)
  return dx, None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def collect_rows(rows, inverse, order, num_rows: int):
  """The expert outputs back in (token, choice) order: `rows [R, d]` (sorted as `dispatch_rows` made
  them, R >= N*k: rows past N*k are padding) -> `[N*k, d]`, row p = `rows[inverse[p]]`.

  `num_rows` is R. The backward is the gather by `order` (the inverse permutation), zero on the
  padding rows, instead of autodiff's scatter.
  """
  return rows[inverse]


def _collect_fwd(rows, inverse, order, num_rows):
  return collect_rows(rows, inverse, order, num_rows), (inverse, order)


def _collect_bwd(num_rows, res, g):
  inverse, order = res
  return jnp.pad(g[order], ((0, num_rows - order.shape[0]), (0, 0))), None, None


collect_rows.defvjp(_collect_fwd, _collect_bwd)


class RouterBias(nnx.Variable):
  """The router's e_score_correction_bias (float32, updated outside gradient descent)."""


def expert_load(indices, token_mask, num_experts: int):
  """Tokens routed to each expert.

  Args:
    indices: int32 `[N, k]` chosen experts per token (`route`'s second output).
    token_mask: bool `[N]`, True for real tokens (padding, segment id 0, is not counted).
    num_experts: E.

  Returns:
    float32 `[E]`: `load_i = #{(n, j): indices[n, j] == i and token_mask[n]}` (sums to k * #tokens).
  """
  w = jnp.broadcast_to(jnp.asarray(token_mask, jnp.float32)[:, None], indices.shape)
  return jnp.zeros((num_experts,), jnp.float32).at[indices.reshape(-1)].add(w.reshape(-1))


def balanced_bias(bias, load, rate: float):
  """One step of auxiliary-loss-free balancing: `bias + rate * sign(mean(load) - load)` (float32 `[E]`).

  An overloaded expert's bias falls by `rate`, an underloaded one's rises, one exactly at the mean
  keeps its bias (sign 0). `rate` is in the units of the sigmoid scores (DeepSeek-V3 uses 1e-3)."""
  load = jnp.asarray(load, jnp.float32)
  return jnp.asarray(bias, jnp.float32) + jnp.float32(rate) * jnp.sign(jnp.mean(load) - load)


def route(logits, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0):
  """The routing rule on float32 router logits.

  Args:
    logits: `[N, E]` router logits (x @ W_gate), float32.
    bias: `[E]` e_score_correction_bias.
    top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: see the module docstring.

  Returns:
    `(weights [N, top_k] float32, indices [N, top_k] int32)`, ordered by decreasing biased score.
  """
  logits = jnp.asarray(logits, jnp.float32)
  e = logits.shape[-1]
  s = jax.nn.sigmoid(logits)
  choice = s + jnp.asarray(bias, jnp.float32)
  if n_group > 1:
    grouped = choice.reshape(choice.shape[:-1] + (n_group, e // n_group))
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)          # [N, G]
    _, keep = jax.lax.top_k(group_score, topk_group)
    gmask = jnp.any(jnp.arange(n_group)[None, :, None] == keep[:, None, :], axis=-1)  # [N, G]
    emask = jnp.repeat(gmask, e // n_group, axis=-1)
    choice = jnp.where(emask, choice, -jnp.inf)
  _, idx = jax.lax.top_k(choice, top_k)
  w = jnp.take_along_axis(s, idx, axis=-1)
  if norm_topk_prob:
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
  return w * routed_scaling_factor, idx.astype(jnp.int32)


class TopKRouter(nnx.Module):
  """`kernel [d, E]` and `e_score_correction_bias [E]`, both float32 whatever `weight_dtype` is.

  The router stays float32 as in transformers' Kimi-Linear (`gate.weight` is kept in float32 there):
  in bf16 the sigmoid scores of near-tied experts round together and the top-k choice can change.
  """

  def __init__(self, args, rngs: nnx.Rngs):
    self.args = args
    self.kernel = param(nnx.initializers.normal(args.initializer_range), rngs.params(),
                        (args.hidden_size, args.num_experts), jnp.float32, ("embed", None))
    self.e_score_correction_bias = RouterBias(jnp.zeros((args.num_experts,), jnp.float32), out_sharding=(None,))

  def __call__(self, x):
    """x `[N, d]` -> (weights `[N, k]` float32, indices `[N, k]` int32)."""
    a = self.args
    logits = jnp.asarray(x, jnp.float32) @ self.kernel[...].astype(jnp.float32)
    return route(logits, self.e_score_correction_bias[...], top_k=a.num_experts_per_tok, n_group=a.n_group,
                 topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                 routed_scaling_factor=a.routed_scaling_factor)


class Experts(nnx.Module):
  """E stacked SwiGLU experts: `w1, w3 [E, d, I]` (gate, up) and `w2 [E, I, d]` (down)."""

  def __init__(self, args, rngs: nnx.Rngs):
    e, d, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
    wdt = as_dtype(args.weight_dtype)
    init = nnx.initializers.normal(args.initializer_range)
    self.w1 = param(init, rngs.params(), (e, d, i), wdt, ("expert", "embed", "mlp"))
    self.w3 = param(init, rngs.params(), (e, d, i), wdt, ("expert", "embed", "mlp"))
    self.w2 = param(init, rngs.params(), (e, i, d), wdt, ("expert", "mlp", "embed"))
    self.dtype = as_dtype(args.dtype)
    self.impl = args.moe_impl
    self.gmm_interpret = False  # run megablox in Pallas interpret mode (tests on a CPU)

  def _dense(self, x, weights, idx):
    # Every expert on every token, combined with a [N, E] weight matrix (zeros off the top-k). The
    # weights scale each expert's hidden activations before its down projection, so the E down
    # projections and their weighted sum are one [N, E*I] x [E*I, d] matmul accumulated in float32:
    # sum_e c_e (h_e W2_e) = sum_e (c_e h_e) W2_e, without an [N, E, d] float32 tensor (256 MiB a layer
    # at 16k tokens, E=4). The compute dtype rounds c_e h_e where it rounded h_e W2_e before.
    e = self.w1.shape[0]
    combine = jnp.sum(jnp.where(idx[..., None] == jnp.arange(e), weights[..., None], 0.0), axis=1)  # [N, E]
    w1, w3, w2 = (p[...].astype(self.dtype) for p in (self.w1, self.w3, self.w2))
    h = jax.nn.silu(jnp.einsum("nd,edi->nei", x, w1)) * jnp.einsum("nd,edi->nei", x, w3)
    scaled = (h.astype(jnp.float32) * combine[..., None]).astype(self.dtype)
    return jnp.einsum("nei,eid->nd", scaled, w2, preferred_element_type=jnp.float32)

  def _ragged(self, x, weights, idx):
    # Sort the N*k (token, expert) pairs by expert and run each expert on its contiguous group, then
    # put the results back in (token, choice) order (the inverse permutation: a gather, not a float32
    # scatter-add) and sum each token's k results weighted in float32 (one fused reduction: no
    # float32 [N*k, d] copy). Buffers: three [N*k, d] and two [N*k, I] in the compute dtype. Both row
    # permutations take gathers in the backward too (dispatch_rows, collect_rows).
    n, k = idx.shape
    e = self.w1.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)                                   # sorted row -> pair
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))  # pair -> row
    xs = dispatch_rows(x.astype(self.dtype), order, inverse, k)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    w1, w3, w2 = (p[...].astype(self.dtype) for p in (self.w1, self.w3, self.w2))
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w1, sizes)) * jax.lax.ragged_dot(xs, w3, sizes)
    y = collect_rows(jax.lax.ragged_dot(h, w2, sizes), inverse, order, n * k).reshape(n, k, -1)
    return combine_choices(weights, y)

  def _megablox(self, x, weights, idx):
    # As _ragged, with the grouped matmuls in jax's Pallas TPU kernel (megablox gmm): each row tile
    # multiplies only its own experts' weights (N*k rows x one expert each, no [E, N*k, I] expansion).
    # The rows are padded to a multiple of the row tile; the padding joins the last group and is dropped.
    n, k = idx.shape
    e = self.w1.shape[0]
    m = n * k
    tm = GMM_LONG_TM if m >= GMM_LONG_ROWS else GMM_ROWS
    rows = -(-m // tm) * tm
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=order.dtype))
    xs = jnp.pad(dispatch_rows(x.astype(self.dtype), order, inverse, k), ((0, rows - m), (0, 0)))
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32).at[e - 1].add(rows - m)
    w1, w3, w2 = (p[...].astype(self.dtype) for p in (self.w1, self.w3, self.w2))
    mm = lambda a, w: grouped_matmul(a, w, sizes, self.dtype, self.gmm_interpret)
    h = jax.nn.silu(mm(xs, w1)) * mm(xs, w3)
    y = collect_rows(mm(h, w2), inverse, order, rows).reshape(n, k, -1)
    return combine_choices(weights, y)

  def _gathered(self, x, weights, idx):
    # Only the chosen experts' weights, gathered per (token, choice): reads N*k experts instead of E.
    w1, w3, w2 = (p[...][idx].astype(self.dtype) for p in (self.w1, self.w3, self.w2))   # [N, k, ...]
    h = jax.nn.silu(jnp.einsum("nd,nkdi->nki", x, w1)) * jnp.einsum("nd,nkdi->nki", x, w3)
    y = jnp.einsum("nki,nkid->nkd", h, w2)
    return jnp.einsum("nk,nkd->nd", weights, y.astype(jnp.float32))

  def __call__(self, x, weights, idx):
    """x `[N, d]`, weights/idx `[N, k]` -> float32 `[N, d]` = sum_k weight * expert_idx(x).

    `moe_impl` ("auto": `resolve_moe_impl`) picks dense, ragged or megablox (TPU only; a CPU run
    needs `gmm_interpret`).

    When fewer (token, expert) pairs than experts are routed (N*k < E, e.g. decoding a few
    sequences), dense and ragged gather only those experts' weights and run them: the same sum,
    reading N*k experts instead of all E (decode is bound by reading weights). Megablox needs no
    gather: it skips the experts no row is routed to (on the v5e, gathering made a real-width decode
    step at B=1 slower than at B=8)."""
    n, k = idx.shape
    impl = resolve_moe_impl(self.impl)
    if n * k < self.w1.shape[0] and impl != "megablox":
      return self._gathered(x, weights, idx)
    return {"dense": self._dense, "ragged": self._ragged, "megablox": self._megablox}[impl](x, weights, idx)


class SparseMoeBlock(nnx.Module):
  """HF `block_sparse_moe`: router `gate`, stacked `experts`, optional `shared_experts`."""

  def __init__(self, args, rngs: nnx.Rngs):
    self.gate = TopKRouter(args, rngs)
    self.experts = Experts(args, rngs)
    self.dtype = as_dtype(args.dtype)
    self.shared_experts = (SwiGLU(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts,
                                  args, rngs) if args.num_shared_experts else None)
    # True: each call also stores its expert choices `[B*T, k]` as the nnx.Intermediate
    # `routed_experts` (set on a model merged inside the training step, for load balancing).
    self.record_routing = False

  def __call__(self, x):
    """`[B, T, d]` -> `[B, T, d]`."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx = self.gate(flat)
    if self.record_routing:
      self.sow(nnx.Intermediate, "routed_experts", idx)
    y = self.experts(flat, weights, idx)
    if self.shared_experts is not None:
      y = y + self.shared_experts(flat).astype(jnp.float32)
    return y.astype(self.dtype).reshape(shape)
