#!/usr/bin/env bash
# The KV digest's Triton path, checked on a machine without a GPU: Triton's interpreter
# (TRITON_INTERPRET=1) runs the kernels with numpy on CPU tensors, and the tests compare every leaf
# digest with the `xxhash` package's XXH3-128 (test/gpu/test_kv_digest_triton.py); then the
# kernels are compiled ahead of time for sm_90 and gfx942 (test/gpu/test_kv_digest_triton_compile.py).
#   usage: scripts/triton-digest-check.sh [pytest args for the interpreter-mode tests]
# The venv ($PDSAFE_TRITON_VENV, default build/venv-triton) holds torch (the CPU build, pinned by
# requirements/constraints-cpu.txt), triton, xxhash, numpy, pytest and NOT sglang: the module under
# test is imported from python/ (PYTHONPATH), so the check needs no fork build. It is created once
# and reused (a stamp file records what was installed). The tests that need sglang's pool classes
# (a whole digest_request, CPU path vs Triton path) skip there; run them in the main venv with
# `TRITON_INTERPRET=1` (see docs/kv-digest.md, "The GPU path").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDSAFE_TRITON_VENV:-build/venv-triton}
PY=${PYTHON:-python3}
C=requirements/constraints-cpu.txt
# triton 3.9.0 is the release torch 2.13.0's own CUDA wheels pin (and the CPU profile installs).
PKGS=(torch==2.13.0 triton==3.9.0 "xxhash>=3.4" numpy pytest)
STAMP="$VENV/.pdsafe-triton-stamp"
want="${PKGS[*]} $(sha256sum "$C" | cut -c1-16)"

start=$(date +%s)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "== venv $VENV (cached)"
else
  echo "== venv $VENV (installing: ${PKGS[*]})"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$C" "${PKGS[@]}" 2>&1 \
    | grep -v -e "^WARNING: Location 'file:" -e '^  WARNING: Location' || true
  "$VENV/bin/python" - <<'PY'
import torch, triton, xxhash
assert torch.version.cuda is None, f"a CUDA torch was installed: {torch.__version__}"
print(f"torch {torch.__version__}, triton {triton.__version__}, xxhash {xxhash.VERSION}")
PY
  echo "$want" > "$STAMP"
fi
installed=$(date +%s)
echo "venv: $((installed - start)) s"

# --noconftest: test/conftest.py imports the test harness (pdsafe_testkit, servers), which this
# venv does not have and these tests do not use.
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --noconftest -ra)
# What the kernels compute: Triton's interpreter vs xxhash (and vs the CPU digest path).
TRITON_INTERPRET=1 PYTHONPATH="$PWD/python" "${PYTEST[@]}" test/gpu/test_kv_digest_triton.py "$@"
interpreted=$(date +%s)
echo "tests (interpreter mode): $((interpreted - installed)) s"
# That they compile: the real Triton pipeline, ahead of time, for sm_90 and gfx942 (no device).
TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH="$PWD/python" "${PYTEST[@]}" \
  test/gpu/test_kv_digest_triton_compile.py
echo "compile test: $(( $(date +%s) - interpreted )) s"
