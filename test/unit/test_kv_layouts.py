"""Every device KV pool class of the installed upstream is classified: covered by the KV digest
or refused with a reason (``sglang.pdsafe.kv_layouts``; issue 20, item 1).

* The installed upstream's source is scanned (text, no imports: the NPU and MLX modules do
  not import on this machine) for every class deriving from ``KVCache`` and not from
  ``HostKVCache`` (host pools are HiCache's, never transferred). The set must equal the table's:
  a class upstream adds fails here until somebody classifies it, and a row for a class that is
  gone fails too.
* Every refused class that imports here is refused by the digest itself, on an instance of the
  real class (built without its constructor: the dispatch reads the class only), with the
  table's reason; every covered class's layout is one the digest reads. A class the table does
  not know is refused with a message that says so.
* ``docs/kv-support.md``'s class table is the table, row for row.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from sglang.pdsafe import kv_digest as kd
from sglang.pdsafe import kv_layouts

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "kv-support.md"


#: A module-level class statement and its base list (which may span lines).
CLASS_RE = re.compile(r"^class (\w+)\(([^)]*)\)\s*:", re.M)


def _upstream_pool_classes() -> set[str]:
    """``module:Name`` of every KVCache (not HostKVCache) subclass in the installed
    ``sglang.srt`` (module-level classes; bases matched by their last name). A regular
    expression over the source, not ``ast``: parsing all of ``sglang.srt`` took 15-35 s."""
    srt = Path(importlib.util.find_spec("sglang").origin).parent / "srt"
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for f in srt.rglob("*.py"):
        rel = f.relative_to(srt)
        if "test" in rel.parts or "tests" in rel.parts:
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        if "class " not in text:
            continue
        module = ".".join(rel.with_suffix("").parts)
        for name, bases in CLASS_RE.findall(text):
            names = [b.split("[")[0].strip().split(".")[-1] for b in bases.split(",")]
            classes.setdefault(name, []).append((module, [b for b in names if b]))

    def derives(name: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == target:
            return True
        return any(b not in seen and derives(b, target, seen | {name})
                   for _, bases in classes.get(name, []) for b in bases)

    return {f"{module}:{name}" for name, defs in classes.items() for module, _ in defs
            if name != "KVCache" and derives(name, "KVCache")
            and not derives(name, "HostKVCache")}


def test_every_upstream_pool_class_is_classified():
    found = _upstream_pool_classes()
    table = set(kv_layouts.CLASSES)
    assert found - table == set(), (
        f"upstream KV pool classes nobody classified (add them to sglang.pdsafe.kv_layouts "
        f"and docs/kv-support.md): {sorted(found - table)}")
    assert table - found == set(), f"classified but not in upstream: {sorted(table - found)}"
    for key, entry in kv_layouts.CLASSES.items():
        assert entry in kv_layouts.LAYOUTS or (entry.startswith("refused: ") and len(entry) > 30), (
            f"{key}: neither a layout the digest reads nor a refusal with a reason: {entry!r}")


#: Run in a child process: importing every upstream pool module (DeepSeek-V4, HiSparse, QSA,
#: MiniMax, unified pools) pulls in modules that start background threads, which must not share
#: the test process with the tests that parse source with ``ast`` (CPython 3.11 raises
#: "AST constructor recursion depth mismatch" when two threads build ASTs at once).
_CHILD = r"""
import importlib, inspect, json, sys
from sglang.pdsafe import kv_digest as kd, kv_layouts
out = {}
for key in sorted(kv_layouts.CLASSES):
    module, name = key.split(":")
    try:
        cls = getattr(importlib.import_module("sglang.srt." + module), name)
    except Exception as e:  # NPU/MLX modules need their hardware's packages
        out[key] = {"imported": False, "why": type(e).__name__}
        continue
    row = {"imported": True, "key_of": kv_layouts.key_of(cls), "qualname": cls.__qualname__,
           "verdict": list(kv_layouts.verdict(cls)), "abstract": inspect.isabstract(cls)}
    if not row["abstract"] and row["verdict"][0] is None:
        try:
            kd.components(object.__new__(cls))  # the dispatch reads the class only
            row["refusal"] = None
        except kd.UnsupportedLayout as e:
            row["refusal"] = str(e)
    out[key] = row
json.dump(out, sys.stdout)
"""


def test_the_digest_refuses_what_the_table_refuses():
    """Every class that imports here: its key, its verdict, and for a refused class the
    digest's own refusal on an instance of the real class, naming the class and the reason."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    imported = {k: r for k, r in rows.items() if r["imported"]}
    assert len(imported) >= 30, f"only {len(imported)} pool modules import here: {rows}"
    for key, row in imported.items():
        entry = kv_layouts.CLASSES[key]
        assert row["key_of"] == key
        if entry in kv_layouts.LAYOUTS:
            assert row["verdict"] == [entry, ""], (key, row)
            continue
        why = entry.removeprefix("refused: ")
        assert row["verdict"] == [None, why], (key, row)
        if row["abstract"]:  # never built (upstream builds its subclasses)
            continue
        msg = row["refusal"]
        assert msg is not None, f"{key}: the digest did not refuse it"
        assert row["qualname"] in msg and why in msg, msg


def test_an_unclassified_subclass_is_refused_as_such():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class Unlisted(MHATokenToKVPool):
        pass

    with pytest.raises(kd.UnsupportedLayout, match="is not classified"):
        kd.components(object.__new__(Unlisted))


def test_the_support_doc_is_the_table():
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| (covered \(([a-z-]+)\)|refused) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(3) or f"refused: {m.group(4)}"
    table = {k: v for k, v in kv_layouts.CLASSES.items()}
    assert rows == table, (
        f"docs/kv-support.md disagrees with sglang.pdsafe.kv_layouts: only in the doc "
        f"{sorted(set(rows.items()) - set(table.items()))}; only in the code "
        f"{sorted(set(table.items()) - set(rows.items()))}")
