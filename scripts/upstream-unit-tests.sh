#!/usr/bin/env bash
# Upstream SGLang's disaggregation unit tests on stock 0.5.23 (CPU-enablement patches only) and on
# the fork (full series): a stock-vs-fork table. See docs/upstream-unit-tests.md.
#   usage: bash scripts/upstream-unit-tests.sh TESTS_DIR [--rev REV] [--out DIR]
#                                              [--stock-upto PATCH] [--update-doc FILE] [-- PYTEST ARGS]
# Uses the project venv (.venv, or $VENV). Exit 0: no test that passes on stock fails on the fork.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${VENV:-$here/../.venv}
exec "$venv/bin/python" "$here/upstream_unit_tests.py" "$@"
