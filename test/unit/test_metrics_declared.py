"""Every declared pdsafe metric is used, and every used one is declared (issue #7, finding 10).

An operator alerts on the names in ``metrics.COUNTERS``/``GAUGES``/``HISTOGRAMS``; a declared
counter that nothing increments is an alert that can never fire. Scans the source of
``sglang.pdsafe``: a metric is "used" where its name appears as a string literal outside
``metrics.py`` (passed to ``metrics.inc``/``observe``/``set_gauge`` directly or through a
constant, as ``coverage.Verdict.counter`` and ``hook_api.MISMATCH_COUNTER`` do), and every
literal passed to them must be declared. Also: ``FAKE_BOOTSTRAP_HOST`` is defined in one place only.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from sglang.pdsafe import metrics

PDSAFE_DIR = Path(metrics.__file__).resolve().parent
DECLARED = {**metrics.COUNTERS, **metrics.GAUGES, **metrics.HISTOGRAMS}


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed once for the whole file (read-only)."""
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(PDSAFE_DIR.glob("*.py"))}


@functools.cache
def _literals_by_module() -> dict[str, frozenset[str]]:
    return {f: frozenset(_string_literals(tree)) for f, tree in _modules().items()}


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _string_literals(tree: ast.Module) -> set[str]:
    skip = _docstrings(tree)
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip}


def _metric_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every ``inc("...")``/``observe("...")`` with a literal name."""
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call) or not n.args:
            continue
        fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        arg = n.args[0]
        if fn in ("inc", "observe", "set_gauge") and isinstance(arg, ast.Constant) and isinstance(
                arg.value, str):
            out.append((n.lineno, arg.value))
    return out


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_declared_metric_is_used_somewhere(name):
    users = [f for f, literals in _literals_by_module().items()
             if f != "metrics.py" and name in literals]
    assert users, f"{name} is declared in metrics.py but nothing in sglang.pdsafe uses it"


def test_every_metric_call_names_a_declared_metric():
    calls = [(f, line, name) for f, tree in _modules().items()
             for line, name in _metric_calls(tree)]
    assert calls, "the scan found no inc()/observe() call at all"
    undeclared = [c for c in calls if c[2] not in DECLARED]
    assert not undeclared, f"inc()/observe() of undeclared metrics: {undeclared}"
    with pytest.raises(KeyError):
        metrics.inc("no_such_counter_total")
    with pytest.raises(KeyError):
        metrics.observe("no_such_histogram_seconds", 1.0)
    with pytest.raises(KeyError):
        metrics.set_gauge("no_such_gauge", 1.0)


def test_scan_sees_a_dead_counter():
    """The scan itself can fail: a name only declared (or only in a docstring) is unused."""
    tree = ast.parse('"""mentions dead_total"""\nmetrics.inc("live_total")\n')
    assert _string_literals(tree) == {"live_total"}
    assert _metric_calls(tree) == [(2, "live_total")]


def test_fake_bootstrap_host_defined_once():
    """One definition (client_guard re-exports upstream's constant); no other module assigns
    or spells the value itself."""
    assigned, spelled = [], []
    for f, tree in _modules().items():
        for n in ast.walk(tree):
            if isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(getattr(t, "id", "") == "FAKE_BOOTSTRAP_HOST" for t in targets):
                    assigned.append(f)
        if "2.2.2.2" in _string_literals(tree):
            spelled.append(f)
    assert assigned == [] and spelled == [], (assigned, spelled)
    from sglang.pdsafe import client_guard
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    assert client_guard.FAKE_BOOTSTRAP_HOST is FAKE_BOOTSTRAP_HOST
