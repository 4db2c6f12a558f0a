#!/usr/bin/env bash
# Training on a lent TPU, in one command (issue 37): install, then
#   step   the whole train step of the 0.4B model (kimi_linear_48b_pattern_0p9b num_experts=4, bf16 compute,
#          f32 weights) at 8 x 2048 packed rows: compile time, step time (median, spread), tokens/s, MFU
#          (6N, and with MLA / KDA attention FLOPs stated apart), compiled memory_analysis and the chip's
#          memory_stats peak; batch sizes 4 and 1 compile beside 8 and the largest that fits is timed
#          (the JSON says when that is not 8); then one more step traced: device time by model part;
#   loss   kda-train (python -m tools.train) of the demo model on tinyshakespeare (TRAIN_CORPUS) with the project's
#          tokenizer, 300 steps: run A SIGTERMed at step >= 150, run B resumes it, run C uninterrupted;
#          the loss curve, resume equality step by step, the compile lines (B and C load from the
#          persistent cache), and the Orbax checkpoints read back on the CPU;
#   split  the step's parts timed alone at the same shapes (KDA mixer, MLA mixer, MoE FFN, dense FFN,
#          head + loss, optimizer; the MoE FFN also under the platform's other expert implementations,
#          `alternatives`), and the KDA training op alone at H=32 T=8192 beside deltanet-tpu's
#          reported 22.5 ms on v6e.
# tools/bench/train_device.py has the phases and the formulas. Each phase is one process under its own time
# limit (budgets below, 9.5 minutes in all, in that order of priority); each writes its JSON as it goes, so
# a phase stopped at its limit still reports what it measured. jax's persistent compilation cache lives in
# $CACHE_DIR for the whole run. Writes $OUT/train_device_check.json (every phase: status, rc, seconds,
# budget, figures; a headline) and $OUT/train_device_logs.txt (all logs): 2 files.
#
# Usage (from anywhere): tools/bench/train_device_check.sh
#   env: OUT (default /tmp/kda_train_out), WORK (default /tmp/kda_train: the phases' runs, logs and
#   figures; the check deletes the *.json files and runs/ in it at start, so give it a directory of its
#   own), PY (the machine's Python with JAX; default
#   /root/.pyenv/versions/3.11.7/bin/python3 when it exists, else python3 as resolved outside the checkout),
#   INDEX (default file:///opt/pypi/simple), WHEELS (wheels the index lacks, default .whl-tpu in the checkout;
#   tools/bench/device_wheels.sh fills it), VENV (default /tmp/kda-train-venv), SKIP_INSTALL=1 (use PY as it
#   is, the checkout on PYTHONPATH), KDA_COMMIT (the commit measured: the device copy has no .git),
#   TRAIN_CORPUS (the text of the loss phase; default .train-data/tinyshakespeare.txt in the checkout, which
#   the device tool carries; without it the repository's docs are used and the JSON says so), TRAIN_SMOKE=1 (tiny model and shapes on the CPU: the test), TRAIN_PHASES (empty or unset: the default,
#   "loss split": the 0.4B step's cold compile took more than 470 s on the lent v5e at 2febcb2, beyond
#   one device command with the other phases; TRAIN_PHASES=step asks for it alone; with TRAIN_SMOKE=1
#   "step loss split profile"; TRAIN_PHASES=profile traces the KDA training op of both implementations at
#   the step's shape, tools/bench/train_op_profile, its device time by source line; TRAIN_PROFILE_IMPLS
#   names which: default "pallas_tpu xla"), TRAIN_STEP_PROFILE_TOP (the step phase's traced step: how many of
#   its largest instructions the JSON lists; 0 skips the trace; default 40), TRAIN_MODEL_SET (model overrides of the step and split phases, e.g.
#   "scan_layers=true remat_policy=none"), TRAIN_BATCHES (default "8 4 1"), TRAIN_DONATE=0 (the step phase
#   then does not donate the train state, as train_step_fn's own jit runs it now; default 1: donated, as
#   model/aot.py compiles it), TRAIN_COMPILED_STEP=FILE (the step phase runs the step in FILE, written on a
#   CPU host by `kda-aot-compile kimi_linear_48b_pattern_0p9b num_experts=4 compile_topology=v5e:1x1
#   mode=train batch_size=8 seq_len=2048 dtype=bfloat16 weight_dtype=float32 steps=1000 warmup_steps=10
#   compiled_trainstep_file=FILE` under this chip's jax and libtpu, instead of compiling it: seconds, not
#   the cold compile; a relative path is taken from the checkout),
#   CACHE_DIR (default /tmp/kda_train_jax_cache), TRAIN_BUDGET_<phase>=SECONDS (e.g. TRAIN_BUDGET_loss=400 with
#   TRAIN_PHASES=loss when its cold compile needs longer; phases: install step loss split profile; whole seconds
#   up to the total, which stays 570 s, 1200 s with TRAIN_SMOKE=1).
# Bad settings exit 2 with one `error:` line naming the variable, before anything is created or cleared:
# TRAIN_SMOKE, TRAIN_DONATE and SKIP_INSTALL other than 0, 1 or empty; TRAIN_PROFILE_IMPLS naming neither
# implementation (or blank); TRAIN_STEP_PROFILE_TOP not a whole number; a TRAIN_BUDGET_<name> whose name is
# not a phase (install step loss split profile); an unknown phase, a bad batch list; a TRAIN_MODEL_SET key (or
# value) the model config refuses (checked with PY and the checkout; when PY lacks the project's packages,
# before the install, the key names alone, and the step phase checks the values).
set -uo pipefail
case "${1:-}" in   # settings are environment variables; an argument would be ignored, so refuse it
  "") ;;
  -h|--help) sed -n '2,/^set -uo pipefail$/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0;;
  *) echo "error: unexpected argument '$1': $(basename "$0") takes no arguments; it is configured by environment variables (--help lists them)" >&2
     exit 2;;
esac
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
# Every check below exits 2 with one line naming the variable, before anything is created or cleared.
for v in TRAIN_SMOKE TRAIN_DONATE SKIP_INSTALL; do   # 0 or 1 (empty: the default); "yes" must not pass for either
  case "${!v:-}" in ""|0|1) ;; *) echo "error: $v='${!v}': expected 0 or 1 (empty: the default)" >&2; exit 2;; esac
done
OUT=${OUT:-/tmp/kda_train_out}
WORK=${WORK:-/tmp/kda_train}
if [ -z "${PY:-}" ]; then
  if [ -x /root/.pyenv/versions/3.11.7/bin/python3 ]; then PY=/root/.pyenv/versions/3.11.7/bin/python3
  else PY=$(cd /tmp && python3 -c 'import sys; print(sys.executable)'); fi
fi
INDEX=${INDEX:-file:///opt/pypi/simple}
WHEELS=${WHEELS:-$ROOT/.whl-tpu}
VENV=${VENV:-/tmp/kda-train-venv}
SMOKE=${TRAIN_SMOKE:-0}
DEFAULT_PHASES="loss split"
[ "$SMOKE" = 1 ] && DEFAULT_PHASES="step loss split profile"   # the CPU smoke test runs every phase
PHASES=${TRAIN_PHASES:-$DEFAULT_PHASES}
CACHE_DIR=${CACHE_DIR:-/tmp/kda_train_jax_cache}
BATCHES=${TRAIN_BATCHES:-8 4 1}
export PYTHONUNBUFFERED=1 KDA_COMPILATION_CACHE_DIR=$CACHE_DIR
DEVICE_PLATFORMS=cpu
[ "$SMOKE" = 1 ] || DEVICE_PLATFORMS=${JAX_PLATFORMS:-tpu,cpu}
export JAX_PLATFORMS=$DEVICE_PLATFORMS
SECONDS=0
TOTAL_BUDGET=570
declare -A BUDGET=([install]=40 [step]=500 [loss]=350 [split]=180 [profile]=240)
if [ "$SMOKE" = 1 ]; then   # a slow shared CPU: the figures do not matter, every phase must run
  TOTAL_BUDGET=1200
  BUDGET=([install]=60 [step]=300 [loss]=500 [split]=300 [profile]=200)
fi
[ -n "${PHASES//[[:space:]]/}" ] || { echo "error: TRAIN_PHASES='$PHASES': expected some of: step loss split profile" >&2; exit 2; }
for p in $PHASES; do   # a typo must not silently drop a phase
  case " step loss split profile " in *" $p "*) ;; *) echo "error: TRAIN_PHASES: unknown phase '$p' (expected some of: step loss split profile)" >&2; exit 2;; esac
done
if [ -n "${TRAIN_PROFILE_IMPLS+set}" ] && [ -z "${TRAIN_PROFILE_IMPLS//[[:space:]]/}" ] && [ -n "${TRAIN_PROFILE_IMPLS}" ]; then
  echo "error: TRAIN_PROFILE_IMPLS='$TRAIN_PROFILE_IMPLS': expected pallas_tpu and/or xla (unset: both)" >&2; exit 2
fi
[[ "${TRAIN_STEP_PROFILE_TOP:-0}" =~ ^[0-9]+$ ]] \
  || { echo "error: TRAIN_STEP_PROFILE_TOP='$TRAIN_STEP_PROFILE_TOP': expected 0 (no traced step) or a count of instructions" >&2; exit 2; }
for impl in ${TRAIN_PROFILE_IMPLS:-}; do
  case "$impl" in pallas_tpu|xla) ;; *) echo "error: TRAIN_PROFILE_IMPLS: unknown implementation '$impl' (expected pallas_tpu and/or xla)" >&2; exit 2;; esac
done
[[ "$BATCHES" =~ ^[[:space:]]*[1-9][0-9]*([[:space:]]+[1-9][0-9]*)*[[:space:]]*$ ]] \
  || { echo "error: TRAIN_BATCHES='$BATCHES': expected batch sizes >= 1 separated by spaces, e.g. '8 4 1'" >&2; exit 2; }
. "$ROOT/tools/bench/device_budgets.sh"   # TRAIN_BUDGET_<phase>=SECONDS overrides a phase's budget
apply_budget_overrides TRAIN_ install step loss split profile
read -r -d '' -a MODEL_KV <<< "${TRAIN_MODEL_SET:-}"   # split on blanks, no glob: kda_layers=[1] stays as written
MODEL_SET=(); for kv in "${MODEL_KV[@]}"; do MODEL_SET+=(--set "$kv"); done
if [ ${#MODEL_SET[@]} -gt 0 ]; then   # a bad key: one line now, not a traceback inside the step phase
  CHECK_ARGS=(--seq-len 2048); [ "$SMOKE" = 1 ] && CHECK_ARGS=(--smoke --seq-len 64)
  # with PY and the checkout (before the install: the key names alone when PY lacks the project's packages)
  check=$(cd / && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu "$PY" -m tools.bench.train_device \
          check-set --set-source TRAIN_MODEL_SET "${CHECK_ARGS[@]}" "${MODEL_SET[@]}" 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then
    last=$(tail -n 1 <<< "$check")
    [ $rc -eq 2 ] && [[ "$last" == "error: TRAIN_MODEL_SET"* ]] && { echo "$last" >&2; exit 2; }
    echo "$check" >&2
    echo "error: TRAIN_MODEL_SET: could not be checked with PY=$PY (exit status $rc, above)" >&2
    exit 2
  fi
  echo "$check"
fi
if [ -n "${TRAIN_CORPUS:-}" ] && [ ! -f "$TRAIN_CORPUS" ]; then
  echo "error: TRAIN_CORPUS='$TRAIN_CORPUS': no such file (expected the text of the loss phase, e.g. tinyshakespeare.txt)" >&2; exit 2
fi
if [ -n "${TRAIN_COMPILED_STEP:-}" ]; then
  [ "$SMOKE" = 1 ] && { echo "error: TRAIN_COMPILED_STEP is for the 0.4B step phase on the chip, not with TRAIN_SMOKE=1 (the smoke step is another program)" >&2; exit 2; }
  case "$TRAIN_COMPILED_STEP" in /*) f="$TRAIN_COMPILED_STEP";; *) f="$ROOT/$TRAIN_COMPILED_STEP";; esac
  [ -f "$f" ] || { echo "error: TRAIN_COMPILED_STEP='$TRAIN_COMPILED_STEP': no such file (expected a kda-aot-compile compiled_trainstep_file)" >&2; exit 2; }
fi
PY_INFO=$(cd / && "$PY" -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__)" 2>&1) \
  || { echo "error: PY='$PY': not a Python with jax (${PY_INFO##*$'\n'}); set PY to the machine's Python with JAX" >&2; exit 2; }
LOGS="$OUT/train_device_logs.txt"
check_dirs OUT WORK CACHE_DIR
mkdir -p "$OUT" "$WORK"   # after the checks: a refused run leaves nothing behind
. "$ROOT/tools/bench/device_phases.sh"   # record, left, run_phase; clears $LOGS and the last run's figures

wants() { [[ " $PHASES " == *" $1 "* ]]; }

# --- install ------------------------------------------------------------------------------------------
echo "== environment: PY=$PY"
echo "${PY_INFO##*$'\n'}"

install_project() {
  local pip=("$VENV/bin/python" -m pip install --isolated --quiet --no-cache-dir --index-url "$INDEX")
  [ -d "$WHEELS" ] && pip+=(--find-links "$WHEELS") && echo "wheels from $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')"
  "$PY" -m venv --system-site-packages "$VENV" || return 1
  if PIP_CONFIG_FILE=/dev/null "${pip[@]}" -e "$ROOT"; then echo "installed with every dependency"; return 0; fi
  local deps missing=()
  deps=$("$VENV/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))")
  while IFS= read -r dep; do
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "$dep" >/dev/null 2>&1 && continue
    missing+=("$dep")
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "${dep%%[<>=!~]*}" >/dev/null 2>&1 && echo "installed an older ${dep%%[<>=!~]*} than $dep"
  done <<< "$deps"
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

DRIVER=("$VPY" -m tools.bench.train_device)
if [ "$SMOKE" = 1 ]; then
  STEP_ARGS=(--smoke --batches "4 2" --seq-len 64 --repeats 2 --steps-per-repeat 2)
  SPLIT_ARGS=(--smoke --batch 2 --seq-len 64 --repeats 2 --steps-per-repeat 2)
  LOSS_ARGS=(--loss-model demo dtype=bfloat16 num_hidden_layers=2 "kda_layers=[1]" "full_attn_layers=[2]"
             --loss-set seq_len=64 batch_size=4 max_num_segments=4 learning_rate=1e-2 warmup_steps=4
             --loss-steps 40 --kill-at 20 --checkpoint-every 10)
else
  STEP_ARGS=(--batches "$BATCHES" --seq-len 2048 --repeats 5 --steps-per-repeat 3)
  [ -n "${TRAIN_STEP_PROFILE_TOP:-}" ] && STEP_ARGS+=(--profile-top "$TRAIN_STEP_PROFILE_TOP")
  [ "${TRAIN_DONATE:-1}" = 0 ] && STEP_ARGS+=(--no-donate)
  if [ -n "${TRAIN_COMPILED_STEP:-}" ]; then
    case "$TRAIN_COMPILED_STEP" in /*) ;; *) TRAIN_COMPILED_STEP="$ROOT/$TRAIN_COMPILED_STEP";; esac
    STEP_ARGS+=(--compiled-step "$TRAIN_COMPILED_STEP")
  fi
  SPLIT_ARGS=(--seq-len 2048 --repeats 5 --steps-per-repeat 3)
  LOSS_ARGS=()
fi

# --- step: the whole train step of the 0.4B model -------------------------------------------------------
if wants step; then
  run_phase step "${DRIVER[@]}" step "${STEP_ARGS[@]}" "${MODEL_SET[@]}" --cache-dir "$CACHE_DIR" --json "$WORK/step.json"
fi

# --- loss: kda-train on real text, killed and resumed ----------------------------------------------------
if wants loss; then
  CORPUS=()
  [ -n "${TRAIN_CORPUS:-}" ] && CORPUS=(--corpus "$TRAIN_CORPUS")
  rm -rf "$WORK/runs"
  # this process reads the checkpoints on the CPU; the kda-train runs get the device
  ( export JAX_PLATFORMS=cpu
    run_phase loss "${DRIVER[@]}" loss "${LOSS_ARGS[@]}" "${CORPUS[@]}" --dir "$WORK/runs" \
      --child-platforms "$DEVICE_PLATFORMS" --cache-dir "$CACHE_DIR" --json "$WORK/loss.json" )
fi

# --- split: the step's parts and the KDA op alone ---------------------------------------------------------
if wants split; then
  B=$("$VPY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('batch_size') or '')" "$WORK/step.json" 2>/dev/null)
  BATCH=(); [ -n "$B" ] && [ "$SMOKE" != 1 ] && BATCH=(--batch "$B")
  run_phase split "${DRIVER[@]}" split "${SPLIT_ARGS[@]}" "${BATCH[@]}" "${MODEL_SET[@]}" --cache-dir "$CACHE_DIR" \
    --json "$WORK/split.json"
fi

# --- profile: the KDA training op's device time by source line, each implementation ---------------------------
profile_op() {   # tools/bench/train_op_profile at the step's shape (tiny with TRAIN_SMOKE=1), one JSON each
  local impl args=()
  [ "$SMOKE" = 1 ] && args=(--smoke --repeats 2 --calls 1)
  for impl in $PROFILE_IMPLS; do
    "$VPY" -m tools.bench.train_op_profile "${args[@]}" --implementation "$impl" --top 40 \
      --compilation-cache-dir "$CACHE_DIR" --json "$WORK/profile_$impl.json" || return $?
  done
}
if wants profile; then
  PROFILE_IMPLS=${TRAIN_PROFILE_IMPLS:-pallas_tpu xla}; [ "$SMOKE" = 1 ] && PROFILE_IMPLS=xla   # the kernel needs a TPU
  export VPY SMOKE CACHE_DIR PROFILE_IMPLS WORK
  run_phase profile profile_op
fi

# --- the report --------------------------------------------------------------------------------------------
# with the phases' Python (its jax version is the one measured); a broken install still gets its report
REPORT_PY=$VPY; "$VPY" -c "" 2>/dev/null || REPORT_PY=$PY
"$REPORT_PY" - "$WORK" "$OUT" "$SECONDS" "$TOTAL_BUDGET" "$SMOKE" "$ROOT" <<'PYEOF'
import json, os, pathlib, re, subprocess, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
total_s, budget_s, smoke = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
phases = {}
for line in (work / "status.tsv").read_text().splitlines():
  name, status, rc, seconds, budget = line.split("\t")
  phases[name] = {"status": status, "rc": int(rc), "seconds": int(seconds), "budget_s": int(budget)}
  f = work / f"{name}.json"
  if f.exists():   # written as the phase went: also what a phase stopped at its limit measured
    phases[name]["result"] = json.loads(f.read_text())
  if name == "profile":   # one JSON per implementation
    phases[name]["result"] = {f.stem[len("profile_"):]: json.loads(f.read_text())
                              for f in sorted(work.glob("profile_*.json"))}
log = (work / "install.log").read_text() if (work / "install.log").exists() else ""
missing = re.findall(r"^MISSING from .*?: (.*)$", log, re.M)
commit = os.environ.get("KDA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True, cwd=sys.argv[6]).stdout.strip()
try:   # only the version: no jax.devices() here, it would open the chip again (the step phase names it)
  import jax
  jax_version = jax.__version__
except ImportError:   # an install that failed: the report says so through its phases
  jax_version = None
step = phases.get("step", {}).get("result", {})
timed = step.get("timed") or {}
loss = phases.get("loss", {}).get("result", {})
split = phases.get("split", {}).get("result", {})
headline = {
    "model": step.get("config"), "batch_size": step.get("batch_size"), "seq_len": step.get("seq_len"),
    "fallback": step.get("fallback"),
    "compile_s": (step.get("compile") or {}).get("wall_s"),
    "step_ms_median": (timed.get("step") or {}).get("median_ms"),
    "tokens_per_s": timed.get("tokens_per_s"), "mfu_6N": timed.get("mfu_6N"),
    "mfu_6N_plus_attention": timed.get("mfu_6N_plus_attention"),
    "memory_analysis_total_gib": ((step.get("batch_candidates") or {}).get(str(step.get("batch_size")), {})
                                  .get("memory_analysis") or {}).get("total_gib"),
    "peak_bytes_in_use": (timed.get("memory_stats_after") or {}).get("peak_bytes_in_use"),
    "step_profile_ms_by_part": (step.get("profile") or {}).get("by_part_ms_per_step"),
    "split_ms": {k: v.get("times_count_ms") for k, v in (split.get("pieces") or {}).items()},
    "split_sum_ms": split.get("pieces_sum_ms"),
    "split_alternatives_ms": {k: v.get("times_count_ms") for k, v in (split.get("alternatives") or {}).items()},
    "kda_op": (split.get("kda_op") or {}).get("op"),
    "kda_op_fwd_bwd_ms": ((split.get("kda_op") or {}).get("forward_backward") or {}).get("median_ms"),
    "kda_op_peer_deltanet_tpu_v6e_ms": ((split.get("kda_op") or {}).get("peer") or {}).get("deltanet_tpu_v6e_ms"),
    "kda_op_fwd_bwd_ms_by_shape": {name: {"op": r.get("op"), "B": r.get("B"), "T": r.get("T"), "H": r.get("H"),
                                          "ms": (r.get("forward_backward") or {}).get("median_ms")}
                                   for name, r in split.items() if name.startswith("kda_op") and isinstance(r, dict)},
    "loss_run": loss.get("command"),
    "loss_first10_mean": loss.get("loss_first10_mean"), "loss_last10_mean": loss.get("loss_last10_mean"),
    "loss_falls": loss.get("loss_falls"), "resume_equal": (loss.get("resume") or {}).get("equal"),
    "checkpoints_read_on_cpu": (loss.get("checkpoints") or {}).get("exported_params_equal_uninterrupted"),
    "kda_op_profile": {impl: {"call_ms": r.get("call_ms"), "in_order_ms": r.get("in_order_ms"),
                              "async_span_ms": r.get("async_span_ms"), "sum_ms": r.get("sum_ms"),
                              "by_source_ms_top10": dict(list((r.get("by_source_ms") or {}).items())[:10])}
                       for impl, r in (phases.get("profile", {}).get("result") or {}).items()},
}
report = {"what": "tools/bench/train_device_check.sh", "commit": commit or "unknown", "smoke": smoke,
          "python": sys.version.split()[0], "jax": jax_version, "device": step.get("device"),
          "install_missing": missing[0].split() if missing else [], "total_s": total_s, "total_budget_s": budget_s,
          "headline": headline, "phases": phases}
(out / "train_device_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
print(json.dumps({k: report[k] for k in ("commit", "total_s", "headline")}, indent=1, default=str))
for name, p in phases.items():
  print(f"{name:8s} {p['status']} ({p['seconds']} s of {p['budget_s']})")
PYEOF
report_rc=$?
echo "== done in ${SECONDS} s"
status=0
grep -q $'\tfailed\|\ttimeout' "$STATUS_FILE" && status=1
[ "$report_rc" -eq 0 ] || { echo "error: the report could not be written (exit $report_rc)" >&2; status=1; }
exit $status
