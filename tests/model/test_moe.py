"""MoE routing against an independent NumPy rule, and both expert implementations against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ModelArgs, load_config
from model.nn.moe import Experts, route
from tests.model import oracle


@pytest.mark.parametrize("n_group, topk_group, norm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_route_matches_numpy_rule(n_group, topk_group, norm):
  rng = np.random.default_rng(n_group * 10 + topk_group)
  logits = rng.normal(0, 2, (32, 16)).astype(np.float32)
  bias = rng.normal(0, 0.5, 16).astype(np.float32)                 # non-zero correction bias
  w, idx = route(jnp.asarray(logits), jnp.asarray(bias), top_k=3, n_group=n_group, topk_group=topk_group,
                 norm_topk_prob=norm, routed_scaling_factor=2.446)
  want_w, want_idx = oracle.route(logits.astype(np.float64), bias.astype(np.float64), 3, n_group, topk_group,
                                  norm, 2.446)
  np.testing.assert_array_equal(np.asarray(idx), want_idx)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6, atol=1e-7)


def test_bias_chooses_but_does_not_weight():
  # Expert 0 has the top score, but a large negative bias removes it from the choice; the weights
  # are the unbiased scores of the chosen experts, renormalised and scaled.
  logits = jnp.asarray([[3.0, 2.0, 1.0, 0.0]])
  w, idx = route(logits, jnp.asarray([-10.0, 0.0, 0.0, 0.0]), top_k=2, routed_scaling_factor=2.0)
  assert np.asarray(idx).tolist() == [[1, 2]]
  s = 1 / (1 + np.exp(-np.array([2.0, 1.0])))
  np.testing.assert_allclose(np.asarray(w)[0], 2.0 * s / s.sum(), rtol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "ragged", "megablox", "megablox_long_rows"])
def test_experts_match_numpy(impl, monkeypatch):
  if impl == "megablox_long_rows":   # the prefill tiling (256-row tiles), reached here with 30 rows
    from model.nn import moe
    monkeypatch.setattr(moe, "GMM_LONG_ROWS", 16)
    impl = "megablox"
  args = ModelArgs.from_config(load_config(["tiny", f"moe_impl={impl}", "num_experts=6", "num_experts_per_tok=3"]))
  with nnx.use_eager_sharding(False):  # no mesh here; axes stay metadata
    experts = Experts(args, nnx.Rngs(3))
  experts.gmm_interpret = True  # megablox is a TPU kernel: Pallas interpret mode on the CPU
  rng = np.random.default_rng(5)
  x = rng.normal(0, 1, (10, args.hidden_size)).astype(np.float32)
  idx = np.stack([rng.choice(6, 3, replace=False) for _ in range(10)]).astype(np.int32)
  w = rng.uniform(0, 1, (10, 3)).astype(np.float32)
  got = np.asarray(experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)))
  w1, w3, w2 = (np.asarray(p.get_value(), np.float64) for p in (experts.w1, experts.w3, experts.w2))
  want = np.zeros((10, args.hidden_size))
  for n in range(10):
    for j in range(3):
      e = idx[n, j]
      h = x[n] @ w1[e]
      want[n] += w[n, j] * ((h / (1 + np.exp(-h)) * (x[n] @ w3[e])) @ w2[e])
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_auto_moe_impl_rule():
  """"auto": dense off a TPU (here: the CPU); megablox is chosen only for a TPU target (covered by
  tests/aot/test_aot_shard_fit.py, whose prefill compiles for one v5e)."""
  from model.nn.moe import resolve_moe_impl
  assert resolve_moe_impl("auto") == "dense"
  assert resolve_moe_impl("ragged") == "ragged" and resolve_moe_impl("megablox") == "megablox"


def test_gmm_tiling_takes_the_largest_weight_tile_that_fits_vmem():
  """Whole expert matrices where they fit megablox's VMEM (the v5e sweep's fastest), else the largest
  dividing tile; each problem (the backward's swapped ones too) gets its own."""
  from model.nn.moe import GMM_LONG_TM, GMM_ROWS, GMM_VMEM_BUDGET, gmm_tiling, gmm_vmem_bytes
  assert gmm_tiling(128, 2304, 1024) == (GMM_ROWS, 2304, 1024)          # 48B decode, w1/w3: whole matrix
  assert gmm_tiling(128, 1024, 2304) == (GMM_ROWS, 1024, 2304)          # 48B decode, w2
  assert gmm_tiling(65536, 2304, 1024) == (GMM_LONG_TM, 2304, 1024)     # 48B prefill, w1/w3 (13.25 MiB)
  # 48B prefill, w2: the whole [1024, 2304] at 256 rows is 15.25 MiB; halves tie, the larger tk wins
  assert gmm_tiling(65536, 1024, 2304) == (GMM_LONG_TM, 1024, 1152)
  assert gmm_vmem_bytes(GMM_LONG_TM, 1024, 2304) > GMM_VMEM_BUDGET
  assert gmm_tiling(16384, 512, 1024) == (GMM_LONG_TM, 512, 1024)       # 0.9B prefill, w2
  assert gmm_tiling(128, 7168, 2048) == (GMM_ROWS, 1024, 2048)          # too large whole: dividing tiles
  assert gmm_tiling(8000, 256, 64) == (GMM_ROWS, 256, 128)              # 128 rows below 8192; the demo's 64
  for m, k, n in [(128, 7168, 2048), (65536, 1024, 2304), (256, 4096, 4096)]:
    assert gmm_vmem_bytes(*gmm_tiling(m, k, n)) <= GMM_VMEM_BUDGET
  # The weight gradient's tgmm accumulates [tk, tn] in float32: the forward's whole-matrix tile of the
  # 48B prefill would ask 22 MiB there, so it gets its own, smaller one.
  from model.nn.moe import tgmm_tiling, tgmm_vmem_bytes
  assert tgmm_vmem_bytes(GMM_LONG_TM, 2304, 1024) > GMM_VMEM_BUDGET
  assert tgmm_tiling(65536, 2304, 1024) == (GMM_LONG_TM, 2304, 512)
  assert tgmm_vmem_bytes(*tgmm_tiling(65536, 2304, 1024)) <= GMM_VMEM_BUDGET
  assert tgmm_tiling(16384, 1024, 512) == (GMM_LONG_TM, 1024, 512)   # the 0.9B expert: whole
  # float32 operands: twice the bytes, smaller tiles (the bf16 whole-matrix tile would ask 26.5 MiB)
  assert gmm_tiling(65536, 2304, 1024, 4) == (GMM_LONG_TM, 768, 1024)
  assert gmm_vmem_bytes(GMM_LONG_TM, 2304, 1024, 4) > GMM_VMEM_BUDGET
  assert gmm_vmem_bytes(*gmm_tiling(65536, 2304, 1024, 4), 4) <= GMM_VMEM_BUDGET




@pytest.mark.parametrize("impl", ["megablox", "ragged"])
def test_grouped_gradients_match_dense(impl, monkeypatch):
  """The grouped paths' backward: megablox's (its gmm with the weight transposed, and tgmm) runs the
  tiling lookup on its own problem shapes; both take the row permutations' gradients by gathers
  (dispatch_rows, collect_rows). The gradients of x, of the routing weights and of every expert
  weight equal the dense path's (megablox with the prefill's 256-row tile, reached here with 30 rows,
  so that padding rows follow the routed ones)."""
  from model.nn import moe
  monkeypatch.setattr(moe, "GMM_LONG_ROWS", 16)
  grads = {}
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(0, 1, (10, 32)), jnp.float32)
  idx = jnp.asarray(np.stack([rng.choice(6, 3, replace=False) for _ in range(10)]), jnp.int32)
  w = jnp.asarray(rng.uniform(0, 1, (10, 3)), jnp.float32)
  for name in ("dense", impl):
    args = ModelArgs.from_config(load_config(["tiny", f"moe_impl={name}", "num_experts=6", "num_experts_per_tok=3"]))
    with nnx.use_eager_sharding(False):
      experts = Experts(args, nnx.Rngs(3))
    experts.gmm_interpret = True
    gd, state = nnx.split(experts)

    def loss(state, x, w):
      y = nnx.merge(gd, state)(x, w, idx)
      return jnp.sum(y * jnp.cos(y))

    grads[name] = jax.grad(loss, argnums=(0, 1, 2))(state, x, w)
  flat = {name: jax.tree.leaves(g) for name, g in grads.items()}
  assert len(flat["dense"]) == 5   # w1, w2, w3, x and the routing weights
  for a, b in zip(flat["dense"], flat[impl]):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-5)


def test_moe_tiling_sweep_candidates_and_routing():
  """tools/bench/moe_tiling_sweep.py: the tilings it times fit VMEM and tile the weight exactly; its
  routing sends each token to top_k distinct experts, the padding to the last group."""
  from model.nn.moe import gmm_vmem_bytes
  from tools.bench import moe_tiling_sweep as sweep
  cands = sweep.candidates(65536, 2304, 1024)
  assert (256, 2304, 1024) in cands and (128, 128, 128) not in cands
  assert all(2304 % tk == 0 and 1024 % tn == 0 and gmm_vmem_bytes(*t) <= sweep.VMEM_BUDGET
             for t in cands for _, tk, tn in [t])
  assert {t[0] for t in sweep.candidates(64, 1024, 2304)} == {128}   # a decode's rows fit one tile
  sizes = sweep.group_sizes(100, 8, 16, 896)
  assert sizes.sum() == 896 and sizes[:-1].max() <= 100 and sizes[-1] >= 896 - 800
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--tokens", "0", "--json", "/dev/null"])
  assert exit_.value.code == 2
  with pytest.raises(SystemExit) as exit_:   # megablox needs a TPU: refused on the CPU without --interpret
    sweep.main(["--config", "tiny", "--json", "/dev/null"])
  assert exit_.value.code == 2
