"""docs/operator-guide.md names every switch, protection and metric the fork has, and nothing
it does not have (issue 11, item 4: "a test that every flag and metric named in the code appears
in the guide and the reverse").

Sources of truth: environment variables ``SGLANG_PDSAFE_*`` in python/sglang/pdsafe and patches/;
server flags the patches add to ``ServerArgs``; the registered protections
(``protections.status``); the declared metrics (``metrics.COUNTERS``/``HISTOGRAMS``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"
ENV_RE = re.compile(r"SGLANG_PDSAFE_[A-Z0-9_]*[A-Z0-9]")
METRIC_RE = re.compile(r"sglang:pdsafe_([a-z0-9_]+)")
FLAG_RE = re.compile(r"--disaggregation-[a-z0-9-]+")


def _code_text() -> str:
    files = [*(REPO / "python" / "sglang" / "pdsafe").glob("*.py"),
             *(REPO / "patches").glob("*.patch")]
    return "\n".join(f.read_text() for f in files)


def _added_flags() -> set[str]:
    """Server flags the series adds (``+`` lines declaring a new ServerArgs field)."""
    flags = set()
    for patch in (REPO / "patches").glob("*.patch"):
        for line in patch.read_text().splitlines():
            m = re.match(r"^\+\s+(disaggregation_[a-z0-9_]+): ", line)
            if m:
                flags.add("--" + m.group(1).replace("_", "-"))
    return flags


def test_every_environment_variable_is_documented_and_exists():
    code = set(ENV_RE.findall(_code_text()))
    guide = set(ENV_RE.findall(GUIDE.read_text()))
    assert code, "found no SGLANG_PDSAFE_* variable in the code: the scan is broken"
    assert code - guide == set(), f"variables missing from the operator guide: {code - guide}"
    assert guide - code == set(), f"the guide names variables the code lacks: {guide - code}"


def test_every_metric_is_documented_and_exists():
    from sglang.pdsafe import metrics

    declared = set(metrics.COUNTERS) | set(metrics.GAUGES) | set(metrics.HISTOGRAMS)
    text = GUIDE.read_text()
    # A histogram's exported series (``_bucket``, ``_sum``, ``_count``) name the histogram.
    documented = set()
    for n in METRIC_RE.findall(text):
        for suffix in ("_bucket", "_sum", "_count"):
            if n.endswith(suffix) and n.removesuffix(suffix) in metrics.HISTOGRAMS:
                n = n.removesuffix(suffix)
        documented.add(n)
    missing = {n for n in declared if f"sglang:pdsafe_{n}" not in text}
    assert missing == set(), f"metrics missing from the operator guide: {sorted(missing)}"
    unknown = {n for n in documented if n not in declared}
    assert unknown == set(), f"the guide names metrics the code lacks: {sorted(unknown)}"


def test_every_protection_is_documented():
    import importlib

    from sglang.pdsafe import protections, startup

    for name in startup.HOOK_MODULES:
        importlib.import_module(name)
    names = {p.name for p in protections.registered()}
    text = GUIDE.read_text()
    assert names, "no protection registered: the scan is broken"
    missing = {n for n in names if f"`{n}`" not in text}
    assert missing == set(), f"protections missing from the operator guide: {sorted(missing)}"


def test_every_server_flag_is_documented_and_exists():
    added = _added_flags()
    text = GUIDE.read_text()
    assert added, "found no flag the patches add: the scan is broken"
    assert {f for f in added if f not in text} == set()
    assert set(FLAG_RE.findall(text)) - added == set(), (
        f"the guide names flags the series does not add: {set(FLAG_RE.findall(text)) - added}")
