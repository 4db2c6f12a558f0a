#!/usr/bin/env bash
# GPU checks of kda_inference on a CUDA machine, in well under 8 minutes:
#   1. the numerics suite on the real (compiled, not interpreted) `pallas_gpu` backend
#      (tests/kernels/test_inference_numerics.py, the `pallas_gpu_device` parametrization);
#   2. tools/benchmark_kda.py at the seed's shapes (B=1, H=8, K=V=128, T = 512 and 8192, bf16 and
#      float32, two packed documents with a boundary that is not 64-aligned): kda_inference's
#      pallas_gpu kernel and xla backend, kda_chunked, tokamax xla_chunked, and fla chunk_kda when
#      torch + fla are importable, with estimated peak memory (markdown table + JSON in OUT).
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
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_inference_numerics.py -k "pallas_gpu_device" --durations=5 2>&1 \
  | tee "$LOG_DIR/numerics.log" || status=1

echo "== 2. tools/benchmark_kda.py (kda_inference on pallas_gpu and xla, kda_chunked, tokamax, fla when importable)"
timeout 200 "$PY" tools/benchmark_kda.py --runs 5 --warmup 1 --output "$LOG_DIR/benchmark_kda.json" ${BENCH_ARGS:-} 2>&1 \
  | tee "$LOG_DIR/benchmark.log" || status=1
exit $status
