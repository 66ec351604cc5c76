#!/usr/bin/env bash
# Install sglang-pdsafe with the CPU profile into a fresh virtual environment.
#   usage: scripts/install-cpu.sh [VENV_DIR]      (default: .venv)
# Installs: Debian libibverbs1 (Mooncake needs libibverbs.so.1; skipped when not root),
# the CPU profile (requirements/cpu.txt under requirements/constraints-cpu.txt: torch 2.13.0 CPU,
# never a CUDA build), then the fork itself with --no-deps (the wheel keeps upstream's GPU
# dependency set in its metadata, which a CPU machine must not resolve), then the test-only
# testkit (test/testkit: harness + fault plugin) editable with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
C=requirements/constraints-cpu.txt
start=$(date +%s)

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== apt: libibverbs1 (for the Mooncake transfer engine)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "warning: libibverbs.so.1 missing and cannot apt-get install it; Mooncake will not load" >&2
  fi
fi

echo "== venv $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { grep -v -e "^WARNING: Location 'file:" -e '^  WARNING: Location' || true; }

echo "== CPU profile (requirements/cpu.txt)"
"${PIP[@]}" install -q -c "$C" -r requirements/cpu.txt 2>&1 | quiet
# Installed without dependencies, as docs/cpu.md explains: nixl's meta package would pull
# both CUDA flavours of the plugin, torchvision's would re-resolve torch.
"${PIP[@]}" install -q --no-deps -c "$C" nixl==1.5.1 torchvision==0.28.0 2>&1 | quiet
profile_done=$(date +%s)

echo "== sglang-pdsafe (pinned upstream wheel + patches/ + python/sglang)"
"${PIP[@]}" install -q --no-deps -c "$C" . 2>&1 | quiet
end=$(date +%s)

# The test profile: the test-only harness + fault plugin (never part of the product wheel),
# editable so test/ and benchmark/ import pdsafe_testkit without path hacks.
echo "== sglang-pdsafe-testkit (test/testkit, editable, test profile)"
"${PIP[@]}" install -q --no-deps -e test/testkit 2>&1 | quiet

"$VENV/bin/python" - <<'PY'
import sglang, torch
assert torch.version.cuda is None, f"a CUDA torch was installed: {torch.__version__}"
print(f"installed sglang {sglang.__version__} on torch {torch.__version__}")
PY
echo "CPU profile: $((profile_done - start)) s; fork build+install: $((end - profile_done)) s;" \
     "venv size: $(du -sh "$VENV" | cut -f1)"
