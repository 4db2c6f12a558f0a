"""The Pallas kernels lower for real hardware from this CPU-only host (ahead-of-time export).

`jax.export` under `jax.sharding.use_abstract_mesh` with an abstract TPU device (TPU v5e, TPU7x)
must yield a Mosaic custom call (`tpu_custom_call`) for every combination of initial state, final
state, gate family and dtype; under an abstract "NVIDIA H200" the GPU kernel must lower to a Triton
custom call for cuda. Lowering runs the Pallas -> Mosaic / Triton IR lowering of the whole kernel
(every primitive must have a lowering rule); the final Mosaic / PTX compilation happens on device
(tools/device_check.sh).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib  # AbstractDevice has no public alias in jax 0.12

from kda_plugin.ops.inference import kda_inference

# jax 0.12 flags the Pallas Triton lowering as deprecated (Mosaic GPU is its successor); the kernel
# targets it deliberately (runs on any CUDA GPU, not only Hopper).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

B, T, H, K, V, N = 2, 130, 2, 128, 64, 3
TRITON = "__gpu$xla.gpu.triton"
GATES = {"pre_activated": None, "softplus": "softplus", "bounded": "bounded"}


def _abstract_mesh(kind, cores, platform):
  device = mesh_lib.AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def _export(backend, platform, mesh, *, with_h0, want_final, gate, dtype):
  sds = jax.ShapeDtypeStruct
  args = [sds((B, T, H, K), dtype), sds((B, T, H, K), dtype), sds((B, T, H, V), dtype),
          sds((B, T, H, K), jnp.float32), sds((B, T, H), dtype), sds((T,), jnp.int32)]
  if with_h0:
    args.append(sds((B, N, H, K, V), jnp.float32))
  if gate is not None:
    args += [sds((H,), jnp.float32), sds((H * K,), jnp.float32)]

  def f(q, k, v, g, beta, seg, *rest):
    rest = list(rest)
    h0 = rest.pop(0) if with_h0 else None
    kw = {}
    if gate is not None:
      kw = dict(a_log=rest[0], dt_bias=rest[1], lower_bound=-3.0 if gate == "bounded" else None)
    return kda_inference(q, k, v, g, beta, segment_ids=seg, initial_state=h0,
                         output_final_state=want_final, max_num_segments=N, use_qk_l2norm=True,
                         implementation=backend, **kw)

  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(f), platforms=(platform,),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
  return exported.mlir_module()


TPU_COMBOS = list(itertools.product([False, True], [False, True], GATES, ["float32", "bfloat16"]))


@pytest.mark.parametrize("kind", ["TPU7x", "TPU v5e"])
def test_tpu_lowers_to_mosaic(kind):
  """Every combination of initial state x final state x gate family x dtype (24 exports, ~8 s)."""
  mesh = _abstract_mesh(kind, 1, "tpu")
  for with_h0, want_final, gate, dtype in TPU_COMBOS:
    text = _export("pallas_tpu", "tpu", mesh, with_h0=with_h0, want_final=want_final,
                   gate=GATES[gate], dtype=jnp.dtype(dtype))
    assert "tpu_custom_call" in text, (kind, with_h0, want_final, gate, dtype)
    assert TRITON not in text


def test_auto_backend_follows_the_abstract_device():
  text = _export("auto", "tpu", _abstract_mesh("TPU7x", 1, "tpu"), with_h0=True, want_final=True,
                 gate="softplus", dtype=jnp.bfloat16)
  assert "tpu_custom_call" in text
  text = _export("auto", "cuda", _abstract_mesh("NVIDIA H200", 132, "gpu"), with_h0=True,
                 want_final=True, gate="softplus", dtype=jnp.bfloat16)
  assert TRITON in text


@pytest.mark.parametrize("with_h0,want_final,gate,dtype", [
    (False, False, None, "bfloat16"), (True, True, "softplus", "bfloat16"),
    (False, True, "bounded", "float32"), (True, False, None, "float32")])
def test_gpu_lowers_to_triton_for_h200(with_h0, want_final, gate, dtype):
  text = _export("pallas_gpu", "cuda", _abstract_mesh("NVIDIA H200", 132, "gpu"), with_h0=with_h0,
                 want_final=want_final, gate=gate, dtype=jnp.dtype(dtype))
  assert TRITON in text
  assert "tpu_custom_call" not in text
