#!/usr/bin/env bash
# The model, the engine and the server on a lent TPU, in one command (issue 35): install, then
#   model     bf16 prefill of one 8192-token prompt and of 16 x 512 packed (TTFT, tok/s, MFU), of one
#             E2E_LONG_PROMPT-token prompt (default 32768; 0 = none; --smoke: 256), and decode
#             steps at B = 1, 8, 32, 64 beside the HBM floor, the time split of both (each kind of piece
#             alone, times its count; decode at B = 64), 0.9B test model with random weights
#             (configs/kimi_linear_48b_pattern_0p9b.py; tools/bench/e2e_device.py has the formulas);
#   ckpt      a random-weights checkpoint of that model (on the CPU, beside the model phase);
#   serving   tools/bench/benchmark_serving.py --online --in-process: continuous vs static engine on a
#             mixed workload (>= 32 requests), prefix cache on/off on shared prefixes (TTFT ratio);
#             its continuous engine compiles cold (the persistent cache starts empty on a fresh machine);
#   identity  f32, B=32: batched greedy tokens equal each request served alone;
#   server    kda-serve --uds with the serving phase's continuous sizes (its executables load from the
#             persistent cache: the warm start; E2E_SERVER_KEYS sets other sizes, then it starts cold),
#             the openai client streaming through the socket;
#   real      (only with E2E_REAL=1, when time is left) the model phase for the real-width shard
#             kimi_linear_48b_a3b num_experts=16 (about 220 s on the chip: E2E_PHASES="model real"
#             E2E_REAL=1 E2E_BUDGET_model=215 E2E_BUDGET_real=315 fits one device command).
# Each phase is one process under its own time limit (budgets below, 9.5 minutes in all); a phase whose
# packages are missing says "skipped: <package> missing" in the JSON instead of running. jax's persistent
# compilation cache lives in $CACHE_DIR for the whole run. Writes $OUT/e2e_device_check.json (every
# phase: status, rc, seconds, budget, figures) and $OUT/e2e_logs.txt (all logs): 2 files.
#
# Usage (from anywhere): tools/bench/e2e_device_check.sh
#   env: OUT (default /tmp/kda_e2e_out), WORK (default /tmp/kda_e2e: the phases' checkpoint, logs and
#   figures; the check deletes the *.json files in it at start, so give it a directory of its own),
#   PY (the machine's Python with JAX; default /root/.pyenv/versions/3.11.7/bin/python3 when it exists,
#   else python3 as resolved outside the checkout),
#   INDEX (default file:///opt/pypi/simple), WHEELS (a directory of wheels the index lacks, default
#   .whl-tpu in the checkout; tools/bench/device_wheels.sh fills it), VENV (default /tmp/kda-e2e-venv),
#   SKIP_INSTALL=1 (use PY as it is, the checkout on PYTHONPATH), KDA_COMMIT (the commit measured),
#   E2E_SMOKE=1 (tiny model and shapes, CPU: the test), E2E_REAL=1, E2E_PHASES (default all:
#   "model ckpt serving identity server real"), CACHE_DIR (default /tmp/kda_e2e_jax_cache),
#   E2E_MODEL_SET (model config overrides for every phase's model, e.g. "moe_impl=ragged attention=kda_chunked"),
#   E2E_PARTIAL_PREFILLS (the serving phase's max_num_partial_prefills, P: prompts a continuous step takes,
#   1 to its max_num_seqs; unset or empty: the engine's default, min(4, max_num_seqs); the server phase's
#   too unless E2E_SERVER_KEYS is given),
#   E2E_SERVER_KEYS (the server phase's engine keys instead of the serving phase's sizes, e.g.
#   "max_num_seqs=4 max_model_len=256 max_num_batched_tokens=64": fewer, smaller executables, so a
#   server phase run without the serving phase's persistent cache compiles in less time),
#   KDA_COMPILE_THREADS (threads that compile an engine's executables; default half the cores),
#   E2E_BUDGET_<phase>=SECONDS (a phase's time limit, phases as in E2E_PHASES plus install; e.g.
#   E2E_BUDGET_model=400 with E2E_PHASES=model; defaults in BUDGET below; model and real need >= 60;
#   the whole check still stops at 570 s, 1500 s with E2E_SMOKE=1: one device command is at most 600 s).
# E2E_SMOKE and SKIP_INSTALL other than 0, 1 or empty, an E2E_LONG_PROMPT that is not whole tokens, an unknown phase, a budget that is not whole
# seconds or names no phase, E2E_SERVER_KEYS words that are not key=value, and an E2E_PARTIAL_PREFILLS that is not a whole number from 1 to the
# serving phase's max_num_seqs (32; 8 with E2E_SMOKE=1), exit 2 with one `error:` line naming the variable, before anything is created or cleared.
set -uo pipefail
case "${1:-}" in   # settings are environment variables; an argument would be ignored, so refuse it
  "") ;;
  -h|--help) sed -n '2,/^set -uo pipefail$/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0;;
  *) echo "error: unexpected argument '$1': $(basename "$0") takes no arguments; it is configured by environment variables (--help lists them)" >&2
     exit 2;;
esac
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
for v in E2E_SMOKE SKIP_INSTALL; do   # 0 or 1 (empty: the default); "yes" must not pass for either
  case "${!v:-}" in ""|0|1) ;; *) echo "error: $v='${!v}': expected 0 or 1 (empty: the default)" >&2; exit 2;; esac
done
[[ -z "${E2E_LONG_PROMPT:-}" || "$E2E_LONG_PROMPT" =~ ^[0-9]+$ ]] || {
  echo "error: E2E_LONG_PROMPT='${E2E_LONG_PROMPT}': expected a whole number of tokens (0 = none)" >&2; exit 2; }
OUT=${OUT:-/tmp/kda_e2e_out}
WORK=${WORK:-/tmp/kda_e2e}
if [ -z "${PY:-}" ]; then
  if [ -x /root/.pyenv/versions/3.11.7/bin/python3 ]; then PY=/root/.pyenv/versions/3.11.7/bin/python3
  else PY=$(cd /tmp && python3 -c 'import sys; print(sys.executable)'); fi
fi
INDEX=${INDEX:-file:///opt/pypi/simple}
WHEELS=${WHEELS:-$ROOT/.whl-tpu}
VENV=${VENV:-/tmp/kda-e2e-venv}
SMOKE=${E2E_SMOKE:-0}
LONG_PROMPT=${E2E_LONG_PROMPT:-32768}
[ "$SMOKE" = 1 ] && LONG_PROMPT=${E2E_LONG_PROMPT:-256}
PHASES=${E2E_PHASES:-model ckpt serving identity server real}
CACHE_DIR=${CACHE_DIR:-/tmp/kda_e2e_jax_cache}
export PYTHONUNBUFFERED=1 KDA_COMPILATION_CACHE_DIR=$CACHE_DIR
[ "$SMOKE" = 1 ] || export JAX_PLATFORMS=${JAX_PLATFORMS:-tpu,cpu}
SECONDS=0
TOTAL_BUDGET=570
declare -A BUDGET=([install]=70 [model]=170 [ckpt]=150 [serving]=200 [identity]=70 [server]=60 [real]=300)
if [ "$SMOKE" = 1 ]; then   # a slow shared CPU: the figures do not matter, every phase must run
  TOTAL_BUDGET=1500
  BUDGET=([install]=60 [model]=300 [ckpt]=300 [serving]=400 [identity]=300 [server]=300 [real]=1)
fi
. "$ROOT/tools/bench/device_budgets.sh"   # E2E_BUDGET_<phase>=SECONDS overrides a phase's budget
apply_budget_overrides E2E_ install model ckpt serving identity server real
for p in model real; do   # these stop their decode batches 45 s before their budget: less leaves them nothing
  v="E2E_BUDGET_$p"
  [ -z "${!v+set}" ] || [ "${BUDGET[$p]}" -ge 60 ] || {
    echo "error: E2E_BUDGET_$p=${BUDGET[$p]}: the $p phase needs at least 60 s (its decode batches stop 45 s before its budget)" >&2
    exit 2; }
done
SMOKE_FLAG=(); [ "$SMOKE" = 1 ] && SMOKE_FLAG=(--smoke)
[ -n "${PHASES//[[:space:]]/}" ] || { echo "error: E2E_PHASES='$PHASES': expected some of: model ckpt serving identity server real" >&2; exit 2; }
for p in $PHASES; do   # a typo must not silently drop a phase
  case " model ckpt serving identity server real " in *" $p "*) ;;
    *) echo "error: E2E_PHASES: unknown phase '$p' (expected some of: model ckpt serving identity server real)" >&2; exit 2;; esac
done
PARTIAL=${E2E_PARTIAL_PREFILLS:-}
SERVE_SEQS=32; [ "$SMOKE" = 1 ] && SERVE_SEQS=8   # the serving phase's max_num_seqs (SERVE_SIZES below)
[[ -z "$PARTIAL" || ( "$PARTIAL" =~ ^[1-9][0-9]{0,3}$ && "$PARTIAL" -le "$SERVE_SEQS" ) ]] || {
  echo "error: E2E_PARTIAL_PREFILLS='$PARTIAL': expected a whole number from 1 to the serving phase's max_num_seqs ($SERVE_SEQS) (prompts a continuous step takes; unset: the engine's default)" >&2
  exit 2; }
read -ra SERVER_KEYS_GIVEN <<< "${E2E_SERVER_KEYS:-}"   # words, never glob-expanded
if [ -n "${E2E_SERVER_KEYS+set}" ] && [ "${#SERVER_KEYS_GIVEN[@]}" = 0 ]; then
  echo "error: E2E_SERVER_KEYS='${E2E_SERVER_KEYS}': expected key=value words (e.g. max_num_seqs=4); unset it for the serving phase's sizes" >&2
  exit 2
fi
for kv in "${SERVER_KEYS_GIVEN[@]}"; do   # key=value words, as tools.serve takes them
  [[ "$kv" =~ ^[a-z_]+=[A-Za-z0-9_.+-]+$ ]] || { echo "error: E2E_SERVER_KEYS: '$kv' is not key=value (e.g. max_num_seqs=4)" >&2; exit 2; }
done
PY_INFO=$(cd / && "$PY" -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__)" 2>&1) \
  || { echo "error: PY='$PY': not a Python with jax (${PY_INFO##*$'\n'}); set PY to the machine's Python with JAX" >&2; exit 2; }
LOGS="$OUT/e2e_logs.txt"
check_dirs OUT WORK CACHE_DIR
mkdir -p "$OUT" "$WORK"   # after the checks: a refused run leaves nothing behind
. "$ROOT/tools/bench/device_phases.sh"   # record, left, run_phase; clears $LOGS and the last run's figures

skip() {  # skip NAME REASON
  record "$1" "skipped: $2" -1 0 "${BUDGET[$1]}"
  echo "== $1: skipped: $2" | tee -a "$LOGS"
}

wants() { [[ " $PHASES " == *" $1 "* ]]; }
stop_after() {  # stop_after PHASE MARGIN: seconds before the phase's decode batches stop, MARGIN s before
  local b; b=$(left)   # the limit run_phase will apply (its budget, or the time left when less)
  [ "${BUDGET[$1]}" -lt "$b" ] && b=${BUDGET[$1]}
  echo $((b > $2 + 5 ? b - $2 : 5))
}

# --- install ------------------------------------------------------------------------------------------
echo "== environment: PY=$PY"
# (jax.devices() would open the chip: ~15 s; the model phase reports the device)
echo "${PY_INFO##*$'\n'}"

install_project() {
  local pip=("$VENV/bin/python" -m pip install --isolated --quiet --no-cache-dir --index-url "$INDEX")
  [ -d "$WHEELS" ] && pip+=(--find-links "$WHEELS") && echo "wheels from $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')"
  "$PY" -m venv --system-site-packages "$VENV" || return 1
  if PIP_CONFIG_FILE=/dev/null "${pip[@]}" -e "$ROOT"; then
    echo "installed with every dependency"
    # the server phase's client (a test extra, not a dependency)
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" openai >/dev/null 2>&1 || echo "MISSING from $INDEX${WHEELS:+ and $WHEELS}: openai"
    return 0
  fi
  local deps missing=()
  deps=$("$VENV/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))")
  while IFS= read -r dep; do
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "$dep" >/dev/null 2>&1 && continue
    missing+=("$dep")
    # an older release of the package is better than none (e.g. the index's orbax-checkpoint): the
    # phases that need the newer API say so when they import it
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "${dep%%[<>=!~]*}" >/dev/null 2>&1 && echo "installed an older ${dep%%[<>=!~]*} than $dep"
  done <<< "$deps"
  PIP_CONFIG_FILE=/dev/null "${pip[@]}" "openai" >/dev/null 2>&1 || missing+=("openai")
  PIP_CONFIG_FILE=/dev/null "${pip[@]}" --no-deps -e "$ROOT" || return 1
  echo "MISSING from $INDEX${WHEELS:+ and $WHEELS}: ${missing[*]}"
  return 0
}
if [ "${SKIP_INSTALL:-0}" = 1 ]; then
  VPY=$PY
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  record install "skipped: SKIP_INSTALL=1 (the checkout on PYTHONPATH)" 0 0 "${BUDGET[install]}"
else
  run_phase install install_project
  VPY="$VENV/bin/python"
  [ -x "$VPY" ] || VPY="$PY"
fi
cd "$WORK"   # the project's .python-version must not pick another Python; the phases find the package installed
[ "${SKIP_INSTALL:-0}" = 1 ] && cd "$ROOT"

# Which imports work: a phase that needs a missing one is skipped with its name.
"$VPY" - > "$WORK/imports.json" <<'PYEOF'
import importlib, json
names = {"flax": "flax", "orbax_v1": "orbax.checkpoint.experimental.v1", "fastapi": "fastapi", "uvicorn": "uvicorn",
         "prometheus_client": "prometheus_client", "openai": "openai", "tiktoken": "tiktoken", "jinja2": "jinja2",
         "sentencepiece": "sentencepiece", "tqdm": "tqdm", "ml_collections": "ml_collections", "kda_plugin": "kda_plugin"}
ok = {}
for key, mod in names.items():
  try:
    importlib.import_module(mod)
    ok[key] = True
  except Exception as e:  # ImportError, or a broken install
    ok[key] = f"{type(e).__name__}: {e}"[:200]
print(json.dumps(ok))
PYEOF
cat "$WORK/imports.json" | tee -a "$LOGS"
missing_of() {  # missing_of KEY...: the first import that failed, or nothing
  "$VPY" -c "import json,sys; ok=json.load(open('$WORK/imports.json')); bad=[k for k in sys.argv[1:] if ok.get(k) is not True]; print(bad[0] if bad else '')" "$@"
}
declare -A PKG_NAME=([orbax_v1]="orbax-checkpoint>=0.12.8 (orbax.checkpoint.experimental.v1)" [prometheus_client]=prometheus-client)
need() {  # need PHASE KEY...: true when every import works, else records the skip
  local m; m=$(missing_of "${@:2}")
  [ -z "$m" ] && return 0
  skip "$1" "${PKG_NAME[$m]:-$m} missing"
  return 1
}

MODEL_SET=(); for kv in ${E2E_MODEL_SET:-}; do MODEL_SET+=(--set "$kv"); done
E2E=("$VPY" -m tools.bench.e2e_device)
CKPT="$WORK/ckpt"
CORE=(flax ml_collections tqdm kda_plugin)

# --- model (device) beside ckpt (CPU) -------------------------------------------------------------------
ckpt_pid=
if wants ckpt && need ckpt "${CORE[@]}" orbax_v1; then
  ( export JAX_PLATFORMS=cpu; run_phase ckpt "${E2E[@]}" checkpoint "${SMOKE_FLAG[@]}" "${MODEL_SET[@]}" --dir "$CKPT" --json "$WORK/ckpt.json" ) &
  ckpt_pid=$!
fi
if wants model && need model "${CORE[@]}"; then
  run_phase model "${E2E[@]}" model "${SMOKE_FLAG[@]}" "${MODEL_SET[@]}" --json "$WORK/model.json" \
    --long-prompt "$LONG_PROMPT" --stop-after-s "$(stop_after model 45)"
fi
[ -n "$ckpt_pid" ] && wait "$ckpt_pid"

# --- serving: continuous vs static, prefix cache ----------------------------------------------------------
if [ "$SMOKE" = 1 ]; then
  # one shape bucket (16): three continuous executables, one static prefill row
  SERVE_SIZES=(--num-requests 8 --concurrency 8 --warmup 2 --prompt-min 4 --prompt-max 16 --output-min 2 --output-max 6
               --prefix-len 64 --suffix-min 4 --suffix-max 12 --max-num-seqs 8 --max-num-batched-tokens 16
               --max-model-len 96)
  SERVER_KEYS=(max_num_seqs=8 max_model_len=96 max_num_batched_tokens=16)
else
  SERVE_SIZES=(--num-requests 32 --concurrency 32 --warmup 4 --prompt-min 16 --prompt-max 512 --output-min 16
               --output-max 128 --prefix-len 512 --suffix-min 16 --suffix-max 128 --max-num-seqs 32
               --max-num-batched-tokens 1024 --max-model-len 768)
  SERVER_KEYS=(max_num_seqs=32 max_model_len=768 max_num_batched_tokens=1024)
fi
if [ -n "$PARTIAL" ]; then
  SERVE_SIZES+=(--max-num-partial-prefills "$PARTIAL")
  SERVER_KEYS+=("max_num_partial_prefills=$PARTIAL")
fi
[ "${#SERVER_KEYS_GIVEN[@]}" -gt 0 ] && SERVER_KEYS=("${SERVER_KEYS_GIVEN[@]}")
have_ckpt() { [ -f "$CKPT/config.json" ] || { skip "$1" "no checkpoint (the ckpt phase did not finish)"; return 1; }; }
if wants serving && need serving "${CORE[@]}" orbax_v1 && have_ckpt serving; then
  run_phase serving "$VPY" "$ROOT/tools/bench/benchmark_serving.py" --online --in-process --checkpoint "$CKPT" \
    --engines continuous,static --workloads mixed,shared_prefix "${SERVE_SIZES[@]}" --json "$WORK/serving.json"
fi

# --- identity: f32 batched vs alone --------------------------------------------------------------------
if wants identity && need identity "${CORE[@]}"; then
  run_phase identity "${E2E[@]}" identity "${SMOKE_FLAG[@]}" "${MODEL_SET[@]}" --json "$WORK/identity.json"
fi

# --- server over a unix socket (warm start after the serving phase) ------------------------------------------------------------
if wants server && need server "${CORE[@]}" orbax_v1 fastapi uvicorn prometheus_client openai tiktoken jinja2 \
   && have_ckpt server; then
  SK=(); for k in "${SERVER_KEYS[@]}"; do SK+=(--serve-key "$k"); done
  run_phase server "${E2E[@]}" server "${SMOKE_FLAG[@]}" --checkpoint "$CKPT" "${SK[@]}" --json "$WORK/server.json"
fi

# --- the real-width shard, when asked and time is left ----------------------------------------------------
if wants real && [ "${E2E_REAL:-0}" = 1 ] && [ "$SMOKE" != 1 ] && need real "${CORE[@]}"; then
  run_phase real "${E2E[@]}" model --config kimi_linear_48b_a3b --set num_experts=16 --set num_experts_per_tok=8 \
    --repeats 3 --json "$WORK/real.json" --stop-after-s "$(stop_after real 40)"
elif wants real; then
  record real "skipped: E2E_REAL is not 1" -1 0 "${BUDGET[real]}"
fi

# --- the report --------------------------------------------------------------------------------------------
"$VPY" - "$WORK" "$OUT" "$SECONDS" "$TOTAL_BUDGET" "$SMOKE" "$ROOT" <<'PYEOF'
import json, os, pathlib, re, subprocess, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
total_s, budget_s, smoke = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
phases = {}
for line in (work / "status.tsv").read_text().splitlines():
  name, status, rc, seconds, budget = line.split("\t")
  phases[name] = {"status": status, "rc": int(rc), "seconds": int(seconds), "budget_s": int(budget)}
  f = work / f"{name}.json"
  if f.exists():   # a phase stopped at its time limit leaves what it measured so far ("partial": true)
    phases[name]["result"] = json.loads(f.read_text())
log = (work / "install.log").read_text() if (work / "install.log").exists() else ""
missing = re.findall(r"^MISSING from .*?: (.*)$", log, re.M)
commit = os.environ.get("KDA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True, cwd=sys.argv[6]).stdout.strip()
import jax   # no jax.devices() here: it would open the chip again (~15 s); the model phase names it
model = phases.get("model", {}).get("result", {})
versions = {"jax": jax.__version__, "device": model.get("device"), "backend": model.get("backend")}
serving = phases.get("serving", {}).get("result", {})
server = phases.get("server", {}).get("result", {})
rows = {r["config"]: r for r in serving.get("rows", [])}
cont = next((r for c, r in rows.items() if c.startswith("engine=continuous")), None)
stat = next((r for c, r in rows.items() if c.startswith("engine=static")), None)
on = next((r for c, r in rows.items() if "prefix cache on" in c), None)
off = next((r for c, r in rows.items() if "prefix cache off" in c), None)
ratio = off["ttft_p50_s"] / on["ttft_p50_s"] if on and off and on.get("ttft_p50_s") else None
headline = {
    "continuous_over_static_output_tok_s": (cont["output_tokens_per_s"] / stat["output_tokens_per_s"]
                                            if cont and stat else None),
    "prefix_cache_ttft_p50_off_over_on": ratio,
    "prefix_cache_line": serving.get("prefix_cache_ratio") or None,
    "cold_start_compile_s": (cont or {}).get("compile", {}).get("seconds"),
    "serving_partial": serving.get("partial"),   # true: the serving phase stopped before its last configuration
    # warm: every executable came from the persistent cache (after the serving phase, same sizes); cold otherwise
    "server_start": (None if "compile_detail" not in server
                     else "warm" if server["compile_detail"].startswith("0 compiled") else "cold"),
    "server_compile_s": server.get("compile_s"),
    "server_startup_s": server.get("server_startup_s"),
    "identity_f32_b32": phases.get("identity", {}).get("result", {}).get("identical"),
    "server_over_uds": phases.get("server", {}).get("result", {}).get("streamed_equals_whole"),
}
report = {"what": "tools/bench/e2e_device_check.sh", "commit": commit or "unknown", "smoke": smoke,
          "python": sys.version.split()[0], **versions, "install_missing": missing[0].split() if missing else [],
          "imports": json.loads((work / "imports.json").read_text()) if (work / "imports.json").exists() else None,
          "total_s": total_s, "total_budget_s": budget_s, "headline": headline, "phases": phases}
(out / "e2e_device_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
print(json.dumps({k: report[k] for k in ("commit", "total_s", "headline")}, indent=1, default=str))
for name, p in phases.items():
  print(f"{name:9s} {p['status']} ({p['seconds']} s of {p['budget_s']})")
PYEOF
report_rc=$?
echo "== done in ${SECONDS} s"
status=0
grep -q $'\tfailed\|\ttimeout' "$STATUS_FILE" && status=1
[ "$report_rc" -eq 0 ] || { echo "error: the report could not be written (exit $report_rc)" >&2; status=1; }
exit $status
