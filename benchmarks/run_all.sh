#!/usr/bin/env bash
# Rerun every benchmark in sequence and print everything (machine info + one table each).
#
#   benchmarks/run_all.sh            # the figures recorded in benchmarks/README.md
#   benchmarks/run_all.sh --quick    # smoke sizes (seconds each)
#
# Extra arguments are passed to every script (so use only flags they all take: --quick).
# vs_trl.py and vs_trl_multiturn.py need trl (pip install -e '.[bench]'); without it, they run agent-r1
# alone (--skip-trl).
# A script that is missing is skipped with a note.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

run() {
    local script="$1"
    shift
    echo
    echo "=== $script $* ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ==="
    if [[ ! -f "benchmarks/$script" ]]; then
        echo "(benchmarks/$script is not there yet: skipped)"
        return
    fi
    "$PYTHON" "benchmarks/$script" "$@"
}

vs_trl_args=()
if ! "$PYTHON" -c "import trl" 2>/dev/null; then
    echo "note: trl is not installed (pip install -e '.[bench]'): vs_trl.py and vs_trl_multiturn.py run agent-r1 only"
    vs_trl_args=(--skip-trl)
fi

run layout.py "$@"
run batch_phases.py "$@"
run logprob_memory.py "$@"
run rollout.py "$@"
run vs_trl.py "${vs_trl_args[@]}" "$@"
run vs_trl_multiturn.py "${vs_trl_args[@]}" "$@"
run multiturn.py "$@"
run credit.py "$@"
run context.py "$@"
run async.py "$@"
run serve_load.py "$@"
