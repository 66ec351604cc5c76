"""The failure-policy table (``docs/failure-policy.md``) agrees with the code, and the check
that says so can fail.

``scripts/pdsafe-patches failure-policy --check`` is CI's gate (this file runs it): every
function of ours that a patch calls is a hook with a declared outcome or a declared
passthrough, every hook is called by a patch or marked pdsafe-internal, every hook's counter
is declared, and the committed table is exactly what the code generates. The other tests
break each of those on purpose (an extra call in a copy of the series; a hook's outcome,
counter or registration changed in this process) and assert the check names the break.

Starts no server; imports the hook modules (the registry) and applies the series to the
pinned upstream wheel's files (a few seconds).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"


def _load(name: str, path: Path) -> ModuleType:
    """A script as a module (``pdsafe-patches`` has no .py); sys.path is left as it was."""
    saved = list(sys.path)
    try:
        loader = importlib.machinery.SourceFileLoader(name, str(path))
        spec = importlib.util.spec_from_loader(name, loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        loader.exec_module(mod)
        return mod
    finally:
        sys.path[:] = saved


fp = _load("pdsafe_failure_policy", ROOT / "scripts" / "failure_policy.py")


@pytest.fixture(scope="module")
def registry() -> tuple[ModuleType, ModuleType]:
    return fp.import_registry()


@pytest.fixture(scope="module")
def found() -> Any:
    return fp.scan(PATCHES)


def _problems(found: Any, registry: tuple[ModuleType, ModuleType]) -> list[str]:
    return fp.check_problems(fp.build(found, *registry), fp.DOC)


def test_table_matches_the_code(registry: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """CI's gate: the command as documented (CONTRIBUTING.md), in this process."""
    pp = _load("pdsafe_patches_cli", ROOT / "scripts" / "pdsafe-patches")
    rc = pp.main(["failure-policy", "--check"])
    err = capsys.readouterr().err
    assert rc == 0, f"scripts/pdsafe-patches failure-policy --check failed:\n{err}"


def test_call_forms_resolve_to_their_hooks(found: Any, registry: Any) -> None:
    """The forms the series uses map to the right rows: a module alias, a function imported
    by name, a re-export, a method that hands its call to a hook through an attribute of
    ours, a call inside a ``pdsafe_*`` method; a constant read is no call."""
    model = fp.build(found, *registry)

    def sites(name: str) -> set[tuple[str, str, str | None]]:
        return {(s.file.rpartition("/")[2], s.scope, via)
                for s, via in model.entries[("hook", name)].sites}

    assert ("schedule_batch.py", "Req.set_finish_with_abort", None) in sites(
        "placeholder_guard.record_rejection")
    assert ("decode.py", "DecodePreallocQueue.add", None) in sites(
        "peer_notifier.decode_rejected")  # called as peer_release.decode_rejected
    assert ("token.py", "TokenToKVPoolAllocator.free", "page_generation.GenerationTable.freed"
            ) in sites("page_generation.freed")
    assert ("conn.py", "CommonKVManager.pdsafe_on_abort_message", None) in sites(
        "peer_release.on_abort_message")
    assert not any("ANNOUNCE_TAG" in name for _, name in model.entries)
    callers = {name: upstream for name, _, _, upstream, _ in model.methods}
    assert any("MooncakeKVManager._handle_abort_notification" in c
               for c in callers["pdsafe_on_abort_message"])


_REFUSED_CALL = re.compile(r"^\+( +)pdsafe_quarantine\.refused\(req\)$")
_HUNK_HEADER = re.compile(r"^(@@ -\d+(?:,\d+)? \+\d+,)(\d+)( @@.*)$", re.DOTALL)


def _with_undeclared_call(dst: Path) -> str:
    """A copy of the series at ``dst`` whose 0019 also calls ``metrics.inc`` (neither a hook
    nor a passthrough) from ``DecodePreallocQueue.add``; returns the patch's name."""
    shutil.copytree(PATCHES, dst)
    for patch in sorted(dst.glob("*.patch")):
        lines = patch.read_text().splitlines(keepends=True)
        for i, ln in enumerate(lines):
            m = _REFUSED_CALL.match(ln.rstrip("\n"))
            if not m:
                continue
            extra = [f"+{m.group(1)}from sglang.pdsafe import metrics as pdsafe_metrics\n",
                     f"+{m.group(1)}pdsafe_metrics.inc('pdsafe_test_total')\n"]
            h = max(j for j in range(i) if lines[j].startswith("@@ "))
            head = _HUNK_HEADER.match(lines[h])
            assert head, lines[h]
            lines[h] = f"{head.group(1)}{int(head.group(2)) + len(extra)}{head.group(3)}"
            lines[i:i] = extra
            patch.write_text("".join(lines))
            return patch.name
    raise AssertionError("no `pdsafe_quarantine.refused(req)` line in the series")


def test_an_undeclared_call_fails_the_check(tmp_path: Path, registry: Any) -> None:
    name = _with_undeclared_call(tmp_path / "patches")
    model = fp.build(fp.scan(tmp_path / "patches"), *registry)
    hits = [p for p in model.problems if "calls metrics.inc, which is neither a hook" in p]
    assert len(hits) == 1, model.problems
    assert hits[0].startswith(f"{name[:4]} python/sglang/srt/disaggregation/decode.py:")
    assert "DecodePreallocQueue.add" in hits[0]
    assert "| `metrics.inc` | `sglang/srt/disaggregation/decode.py`: " in fp.render(model)


def test_a_changed_outcome_makes_the_table_stale(found: Any, registry: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    policy = registry[0]
    assert not any("differs from the generated table" in p for p in _problems(found, registry))
    spec = policy.HOOKS["quarantine.door"]
    assert spec.outcome is policy.Outcome.REFUSE
    monkeypatch.setattr(spec, "outcome", policy.Outcome.HOLD)
    problems = _problems(found, registry)
    assert "docs/failure-policy.md differs from the generated table" in problems[0]
    assert "`quarantine.door` | HOLD" in problems[0]


def test_an_undeclared_counter_fails_the_check(found: Any, registry: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    spec = registry[0].HOOKS["room_guard.claim"]
    monkeypatch.setattr(spec, "counter", "pdsafe_no_such_counter_total")
    assert ("hook room_guard.claim: its counter 'pdsafe_no_such_counter_total' is not "
            "declared in metrics.COUNTERS") in _problems(found, registry)


def test_a_hook_without_call_site_must_be_marked_internal(
        found: Any, registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = registry[0]
    fake = dataclasses.replace(policy.HOOKS["quarantine.door"], name="zz_test.uncalled")
    monkeypatch.setitem(policy.HOOKS, fake.name, fake)
    unmarked = ("hook zz_test.uncalled (quarantine.door) has no call site in any patch and "
                "is not marked pdsafe-internal (HookSpec.internal)")
    assert unmarked in _problems(found, registry)
    fake.internal = True  # what policy.hook(..., internal=True) would declare
    model = fp.build(found, *registry)
    assert unmarked not in model.problems
    assert "| `zz_test.uncalled` | REFUSE | yes |" in fp.render(model)
