#!/usr/bin/env bash
# The KDA kernel on a lent TPU, in one command: install, numerics compiled on the chip, device time.
#   1. installs the project (editable, with its dependencies) into a venv that sees the machine's own
#      JAX, from the machine's package index (INDEX, default file:///opt/pypi/simple); dependencies the
#      index lacks are listed in the report and the kernel checks go on without them;
#   2. runs the kernel numerics compiled for the chip, not interpreted (tests/kernels: test_tpu_device,
#      the pallas_tpu_device cases of test_boundary_exact and test_inference_numerics, the decode
#      kernel's test_decode_tpu_device, the training op's test_chunked_tpu_device);
#   3. times the benchmark shapes in device time (tools/bench/kernel_device_time.py: every case
#      compiled at once in a thread pool, then timed one at a time as a loop inside one jit, median of
#      7 with min/max, beside the HBM and MXU floors);
#   4. writes $OUT/tpu_device_check.json (per phase: exit status, seconds, budget; versions, pytest
#      summary) and $OUT/kernel_device_time.json.
# Budget: under 10 minutes (one device command) on a fresh machine. Each phase runs under its own limit
# (INSTALL_BUDGET 85 s, NUMERICS_BUDGET 330 s, BENCH_BUDGET 160 s: 9.6 min at most; the numerics took
# more than 250 s at c2314be, the training op's device tests 79 s of it); the bench stops starting cases 20 s
# before its limit and writes its JSON after every case, so a limit never loses what was measured.
# Usage (from anywhere): tools/bench/tpu_device_check.sh
#   env: OUT (default /tmp/kda_tpu_check), PY (a Python with the machine's JAX; default python3 as
#   resolved outside the checkout, whose .python-version can name a pyenv Python without JAX),
#   INDEX, VENV (default /tmp/kda-venv), SKIP_INSTALL=1 (reuse VENV), BENCH_ARGS (extra arguments),
#   KDA_COMMIT (the commit measured, when the tree is a copy without git).
#   SMOKE=1: the script's logic on any machine (e.g. a CPU): no install (PY runs everything),
#   JAX_PLATFORMS=cpu, the numerics selection (skipped off a TPU), two benchmark cases at a small size
#   with implementation xla. tests/kernels/test_device_time_tool.py runs it so.
set -uo pipefail
case "${1:-}" in   # settings are environment variables; an argument would be ignored, so refuse it
  "") ;;
  -h|--help) sed -n '2,/^set -uo pipefail$/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0;;
  *) echo "error: unexpected argument '$1': $(basename "$0") takes no arguments; it is configured by environment variables (--help lists them)" >&2
     exit 2;;
esac
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/kda_tpu_check}
. "$ROOT/tools/bench/device_budgets.sh"   # check_dirs
check_dirs OUT
mkdir -p "$OUT"
PY=${PY:-$(cd /tmp && python3 -c 'import sys; print(sys.executable)')}
INDEX=${INDEX:-file:///opt/pypi/simple}
VENV=${VENV:-/tmp/kda-venv}
SMOKE=${SMOKE:-0}
INSTALL_BUDGET=${INSTALL_BUDGET:-85}
NUMERICS_BUDGET=${NUMERICS_BUDGET:-330}
BENCH_BUDGET=${BENCH_BUDGET:-160}
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  SMOKE_BENCH=(--smoke --implementation xla --cases seed_bf16 decode_h24_b32 --repeats 5 --loop-ms 5)
else
  export JAX_PLATFORMS=tpu,cpu
  SMOKE_BENCH=()
fi
export PYTHONUNBUFFERED=1 KDA_TEST_XLA_OPT=default
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kda_jax_cache}
SECONDS=0
declare -A STEP_RC STEP_S

step() {  # step NAME BUDGET_S COMMAND...: runs COMMAND (a program or a function of this script)
  local name=$1 budget=$2 start=$SECONDS  # under a time limit, logs to $OUT/NAME.log
  shift 2
  echo "== $name (budget ${budget} s; at ${SECONDS} s)"
  if declare -F "$1" >/dev/null; then
    export -f "$1"
    export PY INDEX VENV ROOT SMOKE
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
  [ "${SMOKE:-0}" = 1 ] && { echo "SMOKE: no install, $PY runs everything"; return 0; }
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
step install "$INSTALL_BUDGET" install_project
VPY="$VENV/bin/python"
{ [ "$SMOKE" != 1 ] && [ -x "$VPY" ]; } || VPY="$PY"

step numerics "$NUMERICS_BUDGET" "$VPY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
  tests/kernels/test_tpu_device.py tests/kernels/test_boundary_exact.py \
  tests/kernels/test_inference_numerics.py tests/kernels/test_decode_tpu_device.py \
  tests/kernels/test_chunked_tpu_device.py -k "device" --durations=5

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
step bench "$BENCH_BUDGET" "$VPY" -m tools.bench.kernel_device_time --json "$OUT/kernel_device_time.json" \
  --budget-s $((BENCH_BUDGET - 20)) "${SMOKE_BENCH[@]}" ${BENCH_ARGS:-}

"$VPY" - "$OUT" "${STEP_RC[install]}" "${STEP_RC[numerics]}" "${STEP_RC[bench]}" \
  "${STEP_S[install]}" "${STEP_S[numerics]}" "${STEP_S[bench]}" "$SECONDS" \
  "$INSTALL_BUDGET" "$NUMERICS_BUDGET" "$BENCH_BUDGET" "$SMOKE" <<'PYEOF'
import json, os, pathlib, re, subprocess, sys
import jax
out = pathlib.Path(sys.argv[1])
phases = ("install", "numerics", "bench")
rc = dict(zip(phases, map(int, sys.argv[2:5])))
secs = dict(zip(phases, map(int, sys.argv[5:8])))
budget = dict(zip(phases, map(int, sys.argv[9:12])))
log = (out / "numerics.log").read_text() if (out / "numerics.log").exists() else ""
# pytest -q ends with "21 passed, 9 skipped in 95.31s" (framed by "=" without -q)
summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected).*?) in [\d.]+s", log, re.M)
missing = re.findall(r"^MISSING from \S+: (.*)$", (out / "install.log").read_text(), re.M)
commit = os.environ.get("KDA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
report = dict(commit=commit or "unknown", python=sys.version.split()[0], jax=jax.__version__,
              device=jax.devices()[0].device_kind, smoke=sys.argv[12] == "1",
              steps={k: dict(rc=rc[k], seconds=secs[k], budget_s=budget[k]) for k in phases},
              budget_total_s=sum(budget.values()),
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
