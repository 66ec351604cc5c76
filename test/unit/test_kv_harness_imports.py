"""The parent side of the KV harness never imports sglang or torch (``pdsafe_testkit.kv``).

Only the spawned children import them (``child.Side``, ``scheduler_glue`` lanes): the parent
stays light, and a test process that drives KV pairs never runs sglang's import-time side
effects. Checked in a fresh interpreter, where nothing else has imported them yet.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: The parent-side modules (and the child modules the parent imports to name the spawn target).
PARENT_SIDE = (
    "pdsafe_testkit.kv.pages",
    "pdsafe_testkit.kv.results",
    "pdsafe_testkit.kv.rpc",
    "pdsafe_testkit.kv.pair",
    "pdsafe_testkit.kv.child",
    "pdsafe_testkit.kv.scheduler_glue",
    "pdsafe_testkit.kv",
    "pdsafe_testkit.servers",
    "pdsafe_testkit.oracle",
    "pdsafe_testkit.metrics",
)

_PROBE = """
import importlib, json, sys
mods = json.loads(sys.argv[1])
loaded = [importlib.import_module(m).__name__ for m in mods]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "torch"))
print("RESULT" + json.dumps({"loaded": loaded, "heavy": heavy}))
"""


def _probe(mods: tuple[str, ...]) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(mods))],
                       capture_output=True, text=True, timeout=120)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, f"probe failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


def test_parent_side_modules_import_neither_sglang_nor_torch() -> None:
    out = _probe(PARENT_SIDE)
    assert out["loaded"] == list(PARENT_SIDE)
    assert out["heavy"] == [], (
        f"importing the KV harness's parent side pulled in {out['heavy'][:10]}: move those "
        "imports into the child (child.Side / scheduler_glue lanes)")
