#!/usr/bin/env bash
# GPU checks of kda_inference on a CUDA machine, in well under 8 minutes:
#   1. the numerics suite on the real (compiled, not interpreted) `pallas_gpu` backend
#      (tests/kernels/test_inference_numerics.py, the `pallas_gpu_device` parametrization);
#   2. a timing of kda_inference (pallas_gpu, and xla when it exists) at the seed's shapes:
#      B=1, H=8, K=V=128, bf16, two packed documents with a boundary that is not 64-aligned,
#      T = 512 and 8192, median of 10 runs after warm-up, with the estimated peak memory;
#   3. tools/benchmark_kda.py when it is present (its own backend table).
# Usage (repo root or anywhere): tools/device_check.sh   [PY=python3] [OUT=dir for logs]
# Needs a Python with jax + the CUDA plugin (the device image's python3 has them); the repo is used
# through PYTHONPATH, so no install is needed. Exits non-zero when a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG_DIR=${OUT:-/tmp/kda_device_check}
mkdir -p "$LOG_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cuda,cpu     # tests/conftest.py only sets cpu when JAX_PLATFORMS is unset
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

echo "== environment"
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" \
  || { echo "no usable jax with a GPU"; exit 2; }
"$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 3)" \
  || { echo "jax.default_backend() is not 'gpu': nothing to check here"; exit 3; }

echo "== 1. numerics on the compiled pallas_gpu backend"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_inference_numerics.py -k "pallas_gpu_device" --durations=5 2>&1 \
  | tee "$LOG_DIR/numerics.log" || status=1

echo "== 2. kda_inference timing (median of 10, ms) and estimated peak memory"
timeout 180 "$PY" - <<'EOF' 2>&1 | tee "$LOG_DIR/timing.log" || status=1
import importlib.util, time
import jax, jax.numpy as jnp, numpy as np
from kda_plugin.ops.inference import estimate_peak_memory, kda_inference

backends = (["xla"] if importlib.util.find_spec("kda_plugin.ops.inference_xla") else []) + ["pallas_gpu"]
print(f"{'backend':<11}{'T':>6}{'median ms':>11}{'min ms':>9}{'est. peak MB':>14}{'max |o - xla|':>15}")
for t in (512, 8192):
  b, h, d = 1, 8, 128
  keys = jax.random.split(jax.random.key(t), 5)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, h, d), jnp.float32)
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, h, d), jnp.bfloat16)
  g = (-jax.random.uniform(keys[3], (b, t, h, d)) * 0.2).astype(jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h))).astype(jnp.bfloat16)
  cut = t // 2 + 37  # a boundary that is not 64-aligned
  seg = jnp.where(jnp.arange(t) < cut, 1, 2).astype(jnp.int32)
  outs = {}
  for name in backends:
    fn = jax.jit(lambda *a, name=name: kda_inference(*a, segment_ids=seg, max_num_segments=2,
                                                     output_final_state=True, backend=name))
    o, s = fn(q, k, v, g, beta); jax.block_until_ready((o, s))
    ts = []
    for _ in range(10):
      t0 = time.perf_counter(); jax.block_until_ready(fn(q, k, v, g, beta)); ts.append(time.perf_counter() - t0)
    outs[name] = np.asarray(o, np.float32)
    mem = estimate_peak_memory(q, k, v, g, beta, segment_ids=seg, max_num_segments=2,
                               output_final_state=True, backend=name) / 1e6
    diff = float(np.max(np.abs(outs[name] - outs["xla"]))) if "xla" in outs else float("nan")
    print(f"{name:<11}{t:>6}{np.median(ts) * 1e3:>11.3f}{min(ts) * 1e3:>9.3f}{mem:>14.1f}{diff:>15.2e}")
EOF

if [ -f tools/benchmark_kda.py ]; then
  echo "== 3. tools/benchmark_kda.py"
  timeout 240 "$PY" tools/benchmark_kda.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/benchmark.log" || status=1
else
  echo "== 3. tools/benchmark_kda.py not present: skipped"
fi
exit $status
