#!/usr/bin/env bash
# Runs every suite named (make targets) even when one fails, keeps each one's output in
# runs/test-logs/TARGET.log, prints one summary of all of them, and exits non-zero if any failed.
#
#     bash tests/run_suites.sh lint test-main test-vllm test-docker      (what `make test` runs)
#
# PRUNE=1 (what .ci/run sets): a suite's own bulk is removed once it has run, so a machine short of
# disk never holds the vLLM venv (4 GB) and the Docker images (3 GB) at once: .venv-vllm goes after
# test-vllm. `make test` on a workstation keeps it (PRUNE unset).
set -uo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads that wait sleep instead of spinning (tests/conftest.py says why): for every suite
# and every process the tests start
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
logs=runs/test-logs
mkdir -p "$logs"
declare -a rows
failed=0
# the four suites need up to 12 GiB of disk (two venvs, the Docker images; 8.3-8.9 measured with PRUNE=1); say so up front, since
# "No space left on device" halfway through a pip install reads like a packaging bug
free_gib() { df -Pk . | awk 'NR==2 {printf "%.1f", $4 / 1048576}'; }
echo "disk: $(free_gib) GiB free where the suites run"
if awk -v f="$(free_gib)" 'BEGIN {exit !(f < 12)}'; then
    echo "WARNING: under 12 GiB free; the vLLM venv and the Docker image builds may fail for lack of space"
fi
prune() {
    case "$1" in
        test-vllm) rm -rf .venv-vllm ;;
    esac
}
for target in "$@"; do
    echo "=== make $target ==="
    start=$SECONDS
    # each suite under the reaper: what it leaves running is named and stopped before the next one
    python3 tests/reap.py make --no-print-directory "$target" 2>&1 | tee "$logs/$target.log"
    code=${PIPESTATUS[0]}
    took=$((SECONDS - start))
    if [ "${PRUNE:-0}" = 1 ]; then prune "$target" 2>&1 | tee -a "$logs/$target.log"; fi
    # pytest's last line ("= 749 passed, 3 skipped in 840.12s =") or, for lint, what failed
    result=$(grep -E '^=+ .*(passed|failed|error|no tests ran).* =+$' "$logs/$target.log" | tail -1 | tr -d '=' \
             | sed 's/^ *//;s/ *$//')
    if [ "$code" -eq 0 ]; then verdict=ok; else verdict="FAILED (exit $code)"; failed=1; fi
    rows+=("$(printf '%-12s %-18s %6ss  %6s GiB free  %s' "$target" "$verdict" "$took" "$(free_gib)" "${result:-}")")
done
echo
echo "=== summary (logs in $logs/) ==="
printf '%s\n' "${rows[@]}"
echo "disk: $(free_gib) GiB free at the end"
if [ "$failed" -ne 0 ]; then
    echo
    echo "failed tests:"
    grep -hE '^(FAILED|ERROR) ' "$logs"/*.log | sort -u || true
fi
exit "$failed"
