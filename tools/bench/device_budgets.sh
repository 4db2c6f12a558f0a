# Sourced by the device checks before anything is created: <PREFIX>BUDGET_<phase>=SECONDS environment
# variables override the BUDGET associative array (phase -> seconds) of the sourcing script, and
# check_dirs refuses output directories that cannot be.
#
# check_dirs VAR...: each variable names a directory the check creates or reuses (OUT, WORK, CACHE_DIR);
# a value that is empty, exists and is not a directory, or lies under a path that is not a directory
# (so it cannot be created) exits 2 with one `error:` line naming the variable.
check_dirs() {
  local v up
  for v in "$@"; do
    [ -n "${!v}" ] || { echo "error: $v is empty: expected a directory path" >&2; exit 2; }
    if [ -e "${!v}" ] && [ ! -d "${!v}" ]; then
      echo "error: $v='${!v}' exists and is not a directory: expected a directory path (it is created if missing)" >&2
      exit 2
    fi
    up=$(dirname -- "${!v}")
    while [ ! -e "$up" ] && [ "$up" != "$(dirname -- "$up")" ]; do up=$(dirname -- "$up"); done
    if [ ! -d "$up" ]; then
      echo "error: $v='${!v}' cannot be created: '$up' is not a directory" >&2
      exit 2
    fi
  done
}
#
# apply_budget_overrides PREFIX PHASE...: e.g. `apply_budget_overrides E2E_ install model serving` reads
# E2E_BUDGET_model=400. A value that is not whole seconds from 1 to the check's TOTAL_BUDGET (an empty
# one included), or a PREFIXBUDGET_<name> whose name is not one of PHASES (a misspelt phase must not be
# silently ignored), exits 2 with one `error:` line.
apply_budget_overrides() {
  local prefix=$1 kv name k v
  shift
  local known=" $* "
  while IFS= read -r -d '' kv; do
    name=${kv%%=*}
    [[ "$name" == "${prefix}BUDGET_"* ]] || continue
    case "$known" in *" ${name#"${prefix}BUDGET_"} "*) ;;
      *) echo "error: $name: unknown phase '${name#"${prefix}BUDGET_"}' (expected ${prefix}BUDGET_<phase> with a phase of: $*)" >&2
         exit 2;; esac
  done < <(env -0)
  for k in "$@"; do
    v="${prefix}BUDGET_$k"
    if [ -n "${!v+set}" ]; then
      [[ "${!v}" =~ ^[1-9][0-9]{0,5}$ ]] && [ "${!v}" -le "$TOTAL_BUDGET" ] \
        || { echo "error: $v='${!v}': expected whole seconds from 1 to $TOTAL_BUDGET (the whole check's time)" >&2; exit 2; }
      BUDGET[$k]=${!v}
    fi
  done
}
