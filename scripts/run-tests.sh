#!/usr/bin/env bash
# Run the whole CPU test suite (README's test command). usage: scripts/run-tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PDSAFE_LOG_DIR=${PDSAFE_LOG_DIR:-$PWD/build/test-logs}
exec "$VENV/bin/python" -m pytest test -ra -q -p no:cacheprovider "$@"
