"""Real sm_90a compiles of the pallas_gpu kernels on this CPU host (jax CUDA plugin + ptxas, no GPU).

One compile per subprocess in `.venv-gpu-aot` (tests/aot/gpu_kernel_compile.py). The seed shape (B=1,
T=8192, H=8, K=V=128, two packed documents, in-kernel bounded gate and q/k L2 norm, final states) in
bfloat16 and float32 for the H200, bfloat16 for the H100, and a small K/V case. Each must compile with
`--xla_gpu_fail_ptx_compilation_on_register_spilling` (a spill is a compile error) and ptxas must report
0 spill bytes; the KDA kernels' PTX must carry their matmuls on the tensor cores (`mma.sync` /
`wgmma`), with at most 4,370 `fma.rn.f32` (a tenth of the 43,700 of the FMA-only kernel this replaced).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.aot

SEED = ("seq_len=8192", "heads=8", "key_dim=128", "value_dim=128", "num_segments=2")
CASES = {
    "h200_seed_bf16": ("device=h200", "dtype=bfloat16", *SEED),
    "h200_seed_f32": ("device=h200", "dtype=float32", *SEED),
    "h100_seed_bf16": ("device=h100", "dtype=bfloat16", *SEED),
    "h200_small_kv_f32": ("device=h200", "dtype=float32", "seq_len=1000", "heads=4", "key_dim=24",
                          "value_dim=40", "num_segments=5"),
}
MAX_FMA = 4370


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_on_tensor_cores_without_spills(gpu_aot, case):
  report = gpu_aot.run("tests.aot.gpu_kernel_compile", *CASES[case])
  kernels = report["kernels"]
  assert {n.split(".")[0] for n in kernels} >= {"kda_gpu_chunk_prep", "kda_gpu_state_pass"}, kernels
  for name, k in kernels.items():
    assert k["mma"] + k["wgmma"] > 0, (name, k)
    assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
    assert k["registers"] is not None and k["registers"] <= 255, (name, k)
  fma = sum(k["fma_f32"] for k in kernels.values())
  assert fma <= MAX_FMA, (fma, kernels)
  print(f"{case}: compiled in {report['seconds']} s; {kernels}")
