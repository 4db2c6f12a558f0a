#!/usr/bin/env bash
# The KDA kernel on a lent TPU, in one command: install, numerics compiled on the chip, device time.
#   1. installs the project (editable, with its dependencies) into a venv that sees the machine's own
#      JAX, from the machine's package index (INDEX, default file:///opt/pypi/simple); dependencies the
#      index lacks are listed in the report and the kernel checks go on without them;
#   2. runs the kernel numerics compiled for the chip, not interpreted (tests/kernels: test_tpu_device,
#      the pallas_tpu_device cases of test_boundary_exact and test_inference_numerics);
#   3. times the benchmark shapes in device time (tools/bench/kernel_device_time.py: a loop inside one
#      jit, median of 7 with min/max, beside the HBM and MXU floors);
#   4. writes $OUT/tpu_device_check.json (steps, versions, pytest summary) and
#      $OUT/kernel_device_time.json.
# Budget: 8 minutes on a fresh machine. Usage (from anywhere): tools/bench/tpu_device_check.sh
#   env: OUT (default /tmp/kda_tpu_check), PY (a Python with the machine's JAX; default python3 as
#   resolved outside the checkout, whose .python-version can name a pyenv Python without JAX),
#   INDEX, VENV (default /tmp/kda-venv), SKIP_INSTALL=1 (reuse VENV), BENCH_ARGS (extra arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/kda_tpu_check}
mkdir -p "$OUT"
PY=${PY:-$(cd /tmp && python3 -c 'import sys; print(sys.executable)')}
INDEX=${INDEX:-file:///opt/pypi/simple}
VENV=${VENV:-/tmp/kda-venv}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=tpu,cpu KDA_TEST_XLA_OPT=default
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kda_jax_cache}
SECONDS=0
declare -A STEP_RC STEP_S

step() {  # step NAME BUDGET_S COMMAND...: runs COMMAND (a program or a function of this script)
  local name=$1 budget=$2 start=$SECONDS  # under a time limit, logs to $OUT/NAME.log
  shift 2
  echo "== $name (budget ${budget} s; at ${SECONDS} s)"
  if declare -F "$1" >/dev/null; then
    export -f "$1"
    export PY INDEX VENV ROOT
    timeout "$budget" bash -c '"$@"' _ "$@" 2>&1 | tee "$OUT/$name.log"
  else
    timeout "$budget" "$@" 2>&1 | tee "$OUT/$name.log"
  fi
  STEP_RC[$name]=${PIPESTATUS[0]}
  STEP_S[$name]=$((SECONDS - start))
}

echo "== environment"
"$PY" -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
  || { echo "no Python with jax at PY=$PY"; exit 2; }

install_project() {
  [ "${SKIP_INSTALL:-0}" = 1 ] && [ -x "$VENV/bin/python" ] && { echo "reusing $VENV"; return 0; }
  "$PY" -m venv --system-site-packages "$VENV" || return 1
  local pip=("$VENV/bin/python" -m pip install --isolated --quiet --no-cache-dir --index-url "$INDEX")
  # the whole project first; when the index lacks a dependency, each one alone, then the project
  # without dependencies (the report names what is missing)
  if PIP_CONFIG_FILE=/dev/null "${pip[@]}" -e "$ROOT"; then echo "installed with every dependency"; return 0; fi
  local deps missing=()
  deps=$("$VENV/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))")
  while IFS= read -r dep; do
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "$dep" >/dev/null 2>&1 || missing+=("$dep")
  done <<< "$deps"
  PIP_CONFIG_FILE=/dev/null "${pip[@]}" --no-deps -e "$ROOT" || return 1
  echo "MISSING from $INDEX: ${missing[*]}"
  return 3
}
step install 240 install_project
VPY="$VENV/bin/python"
[ -x "$VPY" ] || VPY="$PY"

step numerics 200 "$VPY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
  tests/kernels/test_tpu_device.py tests/kernels/test_boundary_exact.py \
  tests/kernels/test_inference_numerics.py -k "device" --durations=5

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
step bench 200 "$VPY" -m tools.bench.kernel_device_time --json "$OUT/kernel_device_time.json" ${BENCH_ARGS:-}

"$VPY" - "$OUT" "${STEP_RC[install]}" "${STEP_RC[numerics]}" "${STEP_RC[bench]}" \
  "${STEP_S[install]}" "${STEP_S[numerics]}" "${STEP_S[bench]}" "$SECONDS" <<'PYEOF'
import json, os, pathlib, re, subprocess, sys
import jax
out = pathlib.Path(sys.argv[1])
rc = dict(zip(("install", "numerics", "bench"), map(int, sys.argv[2:5])))
secs = dict(zip(("install", "numerics", "bench"), map(int, sys.argv[5:8])))
log = (out / "numerics.log").read_text() if (out / "numerics.log").exists() else ""
summary = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", log, re.M)
missing = re.findall(r"^MISSING from \S+: (.*)$", (out / "install.log").read_text(), re.M)
commit = os.environ.get("KDA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
report = dict(commit=commit or "unknown", python=sys.version.split()[0], jax=jax.__version__,
              device=jax.devices()[0].device_kind, steps={k: dict(rc=rc[k], seconds=secs[k]) for k in rc},
              install_missing=missing[0].split() if missing else [],
              numerics=summary[-1] if summary else None,
              failures=re.findall(r"^FAILED (\S+)", log, re.M), total_seconds=int(sys.argv[8]))
(out / "tpu_device_check.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
PYEOF
status=0
for s in numerics bench; do [ "${STEP_RC[$s]}" -eq 0 ] || status=1; done
[ "${STEP_RC[install]}" -eq 0 ] || [ "${STEP_RC[install]}" -eq 3 ] || status=1
echo "== done in ${SECONDS} s (status $status)"
exit $status
