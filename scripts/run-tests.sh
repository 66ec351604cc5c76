#!/usr/bin/env bash
# Run the whole CPU test suite (README's test command). usage: scripts/run-tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PDSAFE_LOG_DIR=${PDSAFE_LOG_DIR:-$PWD/build/test-logs}
# PDSAFE_ALL_TESTS=1 also runs the tests marked pending_validation (see test/conftest.py).
if [ "${PDSAFE_ALL_TESTS:-0}" = 1 ]; then sel=(); else sel=(-m "not pending_validation"); fi
exec "$VENV/bin/python" -m pytest test -ra -q -p no:cacheprovider "${sel[@]}" "$@"
