"""MLA prefill attention compiled for TPU v5e from this CPU host (`tests/aot/compile_mla_tpu.py`).

- The MLA layer's prefill (no cached prefix) with the shipped `mla_impl=auto` takes the splash kernel
  on TPU (a Mosaic custom call) and its compiled temporaries grow linearly with the row: at 2T they
  are at most 2.25x those at T (the `[B, H, T, T]` float32 scores it replaced grow 4x: 2 GiB a layer
  at T=8192, 32 GiB at 32768). T = 32768 and 65536: below ~16k tokens most of the layer's
  intermediates sit in v5e's 128 MiB of VMEM, which `memory_analysis` does not count, so shorter rows
  would not show the growth.
- The kernel at MLA's head dims (q/k 192, v 128) compiles on the chip's end (jax 0.10.2, libtpu
  0.0.42: topology v5e:2x2, one chip used) forward, backward and in its residual-saving form, and the
  compiled executable takes exactly the arguments a caller passes (the backward traced after a forward).
"""

from __future__ import annotations

import pytest

MODULE = "tests.aot.compile_mla_tpu"


def test_mla_prefill_temporaries_grow_linearly_on_v5e(tpu_aot):
  t = 32768
  one, two = (tpu_aot.run(MODULE, "--chip", "v5e", "--seq-len", str(n), timeout=600) for n in (t, 2 * t))
  for r in (one, two):
    assert r["impl"] == "splash" and r["has_tpu_custom_call"], r
  assert one["temp_bytes"] > 0
  assert two["temp_bytes"] <= 2.25 * one["temp_bytes"], (one, two)
  # An ESTIMATE bound, not a measurement: the dense form's scores alone at T would be H * T * T * 4 bytes.
  assert one["temp_bytes"] < 8 * t * t * 4 / 16


@pytest.mark.parametrize("flags", [(), ("--grad",), ("--with-lse",)], ids=["fwd", "grad", "lse"])
def test_splash_kernel_compiles_on_jax_0_10_2(tpu_aot_jax0102, flags):
  r = tpu_aot_jax0102.run(MODULE, "--chip", "v5e-2x2", "--seq-len", "8192", "--kernel-only", *flags, timeout=600)
  assert r["jax"] == "0.10.2" and r["has_tpu_custom_call"], r
  # The executable takes the 4 arguments and nothing else: a kernel kept from another trace added hidden
  # inputs (its mask metadata), and the compiled train step could not be called on the chip.
  assert r["entry_parameters"] == r["arguments"], r
  # Linear memory: temporaries below one [H, T, T] bf16 block of scores (1 GiB here).
  assert r["temp_bytes"] < 8 * 8192 * 8192 * 2, r


@pytest.mark.parametrize("tokens", [4096, 1057])
def test_mla_decode_keeps_its_latent_cache_in_place_on_v5e(tpu_aot, tokens):
  """One decode step of a 48B MLA layer (S=32 sequences, L=4096 cached rows, bf16, cache donated): the
  latent is padded to whole 128-lane tiles (576 -> 640), so XLA keeps the cache C-minor and the step makes
  no copy of it. At 576 columns XLA laid the cache L-minor and copied all of it twice a step (into the
  row write's layout and back): 168 MB of temporaries and 1332 MB accessed, 7.9x the cache; now 663 MB
  (docs/performance.md, "MLA decode: the latent cache's layout"). A cache for 1057 tokens has 1064 rows
  (`cache.mla_rows`): at 1057 rows XLA laid it L-outermost and copied it whole every step."""
  r = tpu_aot.run(MODULE, "--chip", "v5e", "--decode", "--batch", "32", "--seq-len", str(tokens), timeout=600)
  assert r["cache_length"] == -(-tokens // 8) * 8, r
  assert r["unpadded_width"] == 576 and r["latent_width"] == 640, r
  assert r["cache_layout"] == "2,1,0" and r["cache_copies"] == 0, r
  assert r["temp_bytes"] < r["cache_bytes"] / 4, r
  if tokens == 4096:   # at 1064 rows the cache (44 MB) is small beside what else the step reads
    assert r["bytes_accessed"] < 5 * r["cache_bytes"], r   # the weights (~58 MB) and two reads of the cache fit
