#!/usr/bin/env bash
# Run the whole CPU test suite (README's test command). usage: scripts/run-tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PDSAFE_LOG_DIR=${PDSAFE_LOG_DIR:-$PWD/build/test-logs}
# PDSAFE_ALL_TESTS=1 also runs the tests marked pending_validation (see test/conftest.py).
# The benchmark smoke test (test/test_benchmark_smoke.py) always runs: by default the CI smoke
# (`python -m benchmark.regression --smoke`, the default stack's scenarios, docs/benchmark.md);
# PDSAFE_BENCH=1 makes it run the whole `--quick` matrix instead (longer than CI's budget allows).
if [ "${PDSAFE_ALL_TESTS:-0}" = 1 ]; then sel=()
else sel=(-m "not pending_validation"); fi
# --durations: the slowest tests in the log, to keep CI within its time budget.
exec "$VENV/bin/python" -m pytest test -ra -q -p no:cacheprovider --durations=25 "${sel[@]}" "$@"
