# Sourced by the device checks (e2e_device_check.sh, train_device_check.sh): runs each phase as one
# process under its own time limit and records its status for the JSON the check writes.
# Expects: OUT, WORK (directories), LOGS (the log file every phase appends to), TOTAL_BUDGET (seconds of
# the whole check), BUDGET (an associative array: phase -> seconds), and PY INDEX VENV ROOT WHEELS (exported
# to a phase that is a function of the sourcing script).
STATUS_FILE="$WORK/status.tsv"
: > "$LOGS"
: > "$STATUS_FILE"
rm -f "$WORK"/*.json "$WORK"/*.json.tmp   # a previous run's figures must not pass for this run's

record() {  # record NAME STATUS RC SECONDS BUDGET
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STATUS_FILE"
}

left() { echo $((TOTAL_BUDGET - SECONDS)); }

_PHASE_PID=
_stop_phase() {  # the check was interrupted: stop the running phase (and its children), then exit 130
  local job
  for job in $(jobs -p); do   # this phase's timeout, and a phase run beside it in a background subshell
    kill -TERM "$job" 2>/dev/null
  done
  wait 2>/dev/null
  echo "== interrupted: the running phase was stopped" >&2
  exit 130
}

run_phase() {  # run_phase NAME COMMAND...: under min(its budget, the time left); log appended to $LOGS
  local name=$1 budget=${BUDGET[$1]} start=$SECONDS rc
  shift
  [ "$(left)" -lt "$budget" ] && budget=$(left)
  if [ "$budget" -le 5 ]; then
    record "$name" "skipped: no time left of the ${TOTAL_BUDGET} s budget" -1 0 "${BUDGET[$name]}"
    echo "== $name: skipped (no time left)"
    return
  fi
  echo "== $name (budget ${budget} s; at ${SECONDS} s)" | tee -a "$LOGS"
  # `timeout` runs the phase in a process group of its own, which a Ctrl-C or a SIGTERM sent to the
  # check would not reach: the phase runs in the background and a signal to this shell is passed on
  # to `timeout` (which passes it to the phase), waited for, then the check exits.
  trap '_stop_phase' INT TERM
  if declare -F "$1" >/dev/null; then   # a function of the sourcing script
    export -f "$1"
    export PY INDEX VENV ROOT WHEELS
    timeout -k 10 "$budget" bash -c '"$@"' _ "$@" > "$WORK/$name.log" 2>&1 &
  else
    timeout -k 10 "$budget" "$@" > "$WORK/$name.log" 2>&1 &
  fi
  _PHASE_PID=$!
  wait "$_PHASE_PID"
  rc=$?
  _PHASE_PID=
  trap - INT TERM
  cat "$WORK/$name.log" >> "$LOGS"
  tail -n 25 "$WORK/$name.log"
  local status=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="timeout after ${budget} s"
  [ $rc -ne 0 ] && [ "$status" = ok ] && status="failed (rc $rc)"
  record "$name" "$status" "$rc" $((SECONDS - start)) "${BUDGET[$name]}"
}
