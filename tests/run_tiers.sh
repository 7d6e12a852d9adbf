#!/usr/bin/env bash
# Every test tier, in two pytest processes side by side: the e2e tier (one devcluster, about 20 min,
# a third of it waiting on timeouts, schedulers and outages) beside the others (integration, mostly
# waiting on an apiserver, then trainer and unit), which take about as long one after the other.
# Serially the suite left the 2 cores 43% idle. Usage: tests/run_tiers.sh PYTHON [PYTEST_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
python="$1"
shift
e2e_log="$(mktemp -t tpujob-e2e.XXXXXX.log)"
# The e2e process keeps no pytest cache: two processes writing .pytest_cache at once could tear it.
"$python" -m pytest tests/e2e -p no:cacheprovider "$@" >"$e2e_log" 2>&1 &
e2e_pid=$!
trap 'kill "$e2e_pid" 2>/dev/null' INT TERM
"$python" -m pytest --ignore=tests/e2e "$@"
rest=$?
echo "--- waiting for the e2e tier (log: $e2e_log)"
wait "$e2e_pid"
e2e=$?
echo "=============================== the e2e tier ==============================="
cat "$e2e_log"
echo "tiers: e2e exit $e2e, the others exit $rest"
# 5: pytest collected nothing, as when PYTEST_ARGS deselects a whole side (-m 'not e2e').
[[ $rest -eq 0 || $rest -eq 5 ]] && [[ $e2e -eq 0 || $e2e -eq 5 ]]
