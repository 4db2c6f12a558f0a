#!/usr/bin/env bash
# GPU checks of kda_inference on a CUDA machine, within 5 minutes including every compile (a lent device
# has 15 minutes in all, start-up included, and a rerun must fit):
#   1. the numerics suite on the real (compiled, not interpreted) `pallas_gpu` backend
#      (tests/kernels/test_inference_numerics.py, the `pallas_gpu_device` parametrization; each distinct
#      signature is one ~10 s Triton + ptxas compile of the two kernels), at most 120 s;
#   2. tools/benchmark_kda.py at the seed's shapes (B=1, H=8, K=V=128, T = 512 and 8192, bf16 and
#      float32, two packed documents with a boundary that is not 64-aligned): kda_inference's pallas_gpu
#      kernels against fla chunk_kda (when torch + fla are importable), at most 150 s. The CPU-speed
#      backends (xla, kda_chunked, tokamax) are left out: their compiles would not fit; BENCH_BACKENDS
#      overrides the list.
# Compiles are cached in $OUT/jax_cache, so a rerun on the same machine skips them.
# Usage (repo root or anywhere): tools/device_check.sh   [PY=python3] [OUT=dir for logs]
# Needs a Python with jax + the CUDA plugin (the device image's python3 has them); the repo is used
# through PYTHONPATH, so no install is needed. Exits non-zero when a step fails or runs out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LOG_DIR=${OUT:-/tmp/kda_device_check}
mkdir -p "$LOG_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cuda,cpu     # tests/conftest.py only sets cpu when JAX_PLATFORMS is unset
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="$LOG_DIR/jax_cache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
BENCH_BACKENDS=${BENCH_BACKENDS:-kda_inference_pallas_gpu fla_chunk_kda}
status=0
SECONDS=0

echo "== environment"
"$PY" -c "import jax, jaxlib, sys; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices()); sys.exit(0 if jax.default_backend() == 'gpu' else 3)"
rc=$?
[ $rc -eq 3 ] && { echo "jax.default_backend() is not 'gpu': nothing to check here"; exit 3; }
[ $rc -ne 0 ] && { echo "no usable jax with a GPU"; exit 2; }

echo "== 1. numerics on the compiled pallas_gpu backend (budget 120 s; at ${SECONDS} s)"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_inference_numerics.py -k "pallas_gpu_device" --durations=5 2>&1 \
  | tee "$LOG_DIR/numerics.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2. tools/benchmark_kda.py: ${BENCH_BACKENDS} (budget 150 s; at ${SECONDS} s)"
# shellcheck disable=SC2086  # BENCH_BACKENDS is a list of names
timeout 150 "$PY" tools/benchmark_kda.py --runs 5 --warmup 1 --backends $BENCH_BACKENDS \
  --output "$LOG_DIR/benchmark_kda.json" ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/benchmark.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== done in ${SECONDS} s (status $status)"
exit $status
