"""docs/alerts/pdsafe-rules.yml has a rule for every alert docs/operator-guide.md recommends, and
every metric a rule names exists (issue 22, item 4).

* The rules file parses (PyYAML) as Prometheus rule groups; every rule has an alert name (unique),
  an expression, a severity (page, ticket or warning) and a summary.
* Every ``sglang:pdsafe_*`` series an expression names is a metric declared in
  ``sglang.pdsafe.metrics``, under the name Prometheus exports for its type: a counter
  ``X_total`` as declared, a gauge as declared, a histogram only as ``X_bucket`` / ``X_sum`` /
  ``X_count``. Every other ``sglang:*`` series is declared by the installed upstream's metrics
  collector (``sglang/srt/observability/metrics_collector.py``).
* Every row of the guide's metric table whose alert column recommends an alert (page, ticket,
  warn, "alert if") has a rule that names the metric; a row that says **page** has a rule of
  severity page naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docs" / "alerts" / "pdsafe-rules.yml"
GUIDE = REPO / "docs" / "operator-guide.md"
SERIES_RE = re.compile(r"sglang:[A-Za-z0-9_:]*[A-Za-z0-9_]")
SEVERITIES = {"page", "ticket", "warning"}
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def rules() -> list[dict]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def _upstream_metrics() -> set[str]:
    import sglang.srt.observability.metrics_collector as mc

    return set(re.findall(r'name="(sglang:[A-Za-z0-9_:]+)"', Path(mc.__file__).read_text()))


def _pdsafe_series_ok(series: str) -> bool:
    from sglang.pdsafe import metrics

    name = series.removeprefix(metrics.PREFIX)
    if name in metrics.COUNTERS or name in metrics.GAUGES:
        return True
    return any(name.endswith(s) and name.removesuffix(s) in metrics.HISTOGRAMS
               for s in HIST_SUFFIXES)


def _upstream_series_ok(series: str, declared: set[str]) -> bool:
    return series in declared or any(series.endswith(s) and series.removesuffix(s) in declared
                                     for s in HIST_SUFFIXES)


def _metric_of(series: str) -> str:
    """The guide's name of the metric behind an exported series (histogram parts folded)."""
    from sglang.pdsafe import metrics

    name = series.removeprefix(metrics.PREFIX)
    for s in HIST_SUFFIXES:
        if name.endswith(s) and name.removesuffix(s) in metrics.HISTOGRAMS:
            return name.removesuffix(s)
    return name


def recommended() -> dict[str, str]:
    """metric (as declared) -> the guide's alert cell, for rows that recommend an alert."""
    text = GUIDE.read_text().split("## Metrics and alerts", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        m = re.match(r"\| `sglang:pdsafe_([a-z0-9_]+)`(?: \([a-z]+\))? \|", line)
        if not m:
            continue
        alert = line.rstrip().rstrip("|").rsplit(" | ", 1)[1].strip()
        if alert.startswith("covered by"):
            continue
        if re.search(r"\b(page|ticket|warn|alert)\b", alert.replace("*", "")):
            out[m.group(1)] = alert
    return out


def test_rules_parse_and_are_complete():
    rs = rules()
    assert rs, "no rules"
    names = [r.get("alert") for r in rs]
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    for r in rs:
        assert r.get("alert") and isinstance(r.get("expr"), str) and r["expr"].strip(), r
        assert r.get("labels", {}).get("severity") in SEVERITIES, r
        assert r.get("annotations", {}).get("summary"), r
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


def test_every_metric_a_rule_names_exists():
    from sglang.pdsafe import metrics

    upstream = _upstream_metrics()
    assert "sglang:kv_transfer_latency_ms" in upstream, "the upstream scan is broken"
    bad = []
    for r in rules():
        for series in SERIES_RE.findall(r["expr"]):
            ok = (_pdsafe_series_ok(series) if series.startswith(metrics.PREFIX)
                  else _upstream_series_ok(series, upstream))
            if not ok:
                bad.append((r["alert"], series))
    assert not bad, f"rules name series no metric exports: {bad}"


def test_every_recommended_alert_has_a_rule():
    rec = recommended()
    assert len(rec) > 30, f"the guide's table scan found only {sorted(rec)}"
    named: dict[str, set[str]] = {}
    for r in rules():
        for series in SERIES_RE.findall(r["expr"]):
            named.setdefault(_metric_of(series), set()).add(r["labels"]["severity"])
    missing = sorted(m for m in rec if m not in named)
    assert not missing, f"alerts the operator guide recommends without a rule: {missing}"
    not_paged = sorted(m for m, cell in rec.items()
                       if cell.startswith("**page**") and "page" not in named[m])
    assert not not_paged, f"the guide pages on these, the rules do not: {not_paged}"


def test_the_digest_not_running_rule():
    """``kv_digest_verified_total`` flat while PD transfers complete: the only signal that the
    digest is off somewhere. It must not need the counter to exist (absent = never moved)."""
    r = next(r for r in rules() if "kv_digest_verified_total" in r["expr"])
    assert "unless" in r["expr"] and "kv_transfer_latency_ms_count" in r["expr"], r["expr"]
