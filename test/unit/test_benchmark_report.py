"""The benchmark's report writer and overhead statistics (no server).

report.json is what CI and operators read: these tests pin its schema (every cell key, every
registered scenario present per variant, not-implemented ones included), the exit-status rule
(fork leak or hang -> 1, base leaks alone -> 0) and the overhead ratio arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark import report as rpt
from benchmark.outcomes import Outcome, RequestRecord
from benchmark.overhead import Burst, percentile, summarize
from benchmark.scenarios import SCENARIOS, _planned, applicable, select


def _rec(label: str, outcome: Outcome, **kw) -> RequestRecord:
    return RequestRecord(label, "router", 64, 16, outcome, phase="p", **kw)


def _cells(fork_leak: bool = False) -> list[rpt.Cell]:
    base = rpt.Cell("spoof-fake-bootstrap-host", "spoof", "mooncake", 1, "base",
                    records=[_rec("victim-0", Outcome.IDENTICAL),
                             _rec("spoof-host-0", Outcome.LEAK, leaked_from=["victim-0"],
                                  attribution="victim-0 x16", detail="HTTP 200 with other")],
                    reservations={"pages_reserved": 0, "requests_parked": 0})
    fork = rpt.Cell("spoof-fake-bootstrap-host", "spoof", "mooncake", 1, "fork",
                    records=[_rec("victim-0", Outcome.IDENTICAL),
                             _rec("spoof-host-0", Outcome.LEAK if fork_leak
                                  else Outcome.EXPLICIT_ERROR)],
                    reservations={"pages_reserved": 3, "requests_parked": 1})
    ni = [rpt.Cell(PLANNED.name, "room", "mooncake", 1, v,
                   status="not_implemented", reason="needs the ownership stage's fault hook")
          for v in ("base", "fork")]
    return [base, fork, *ni]


#: A registered, not implemented scenario (the registry has none at the moment).
PLANNED = _planned("room-planned", "room", "a planned scenario: its doc says what a leak is",
                   "ownership")


def _scen() -> dict[str, dict]:
    return {"spoof-fake-bootstrap-host": SCENARIOS["spoof-fake-bootstrap-host"].describe(),
            PLANNED.name: PLANNED.describe()}


def test_report_json_schema_and_files(tmp_path: Path) -> None:
    meta = {"versions": {"base": "0.5.23", "fork": "0.5.23+pdsafe.1"}, "mode": "harness",
            "quick": True, "timing": {"total_s": 1.0}}
    rep = rpt.write_all(meta, _scen(), _cells(), None, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data == json.loads(json.dumps(rep, default=str))
    assert set(rpt.TOP_KEYS) <= set(data)
    assert data["versions"] == {"base": "0.5.23", "fork": "0.5.23+pdsafe.1"}
    for cell in data["results"]:
        assert set(rpt.CELL_KEYS) <= set(cell), set(rpt.CELL_KEYS) - set(cell)
        assert cell["status"] in rpt.CELL_STATUSES
    spoof = {c["variant"]: c for c in data["results"]
             if c["scenario"] == "spoof-fake-bootstrap-host"}
    assert spoof["base"]["leaks"] == 1 and spoof["base"]["sent"] == 2
    assert spoof["base"]["leak_details"][0]["content_from"] == ["victim-0"]
    assert spoof["fork"]["explicit_errors"] == 1 and spoof["fork"]["leaks"] == 0
    assert spoof["fork"]["pages_reserved_after"] == 3
    ni = [c for c in data["results"] if c["scenario"] == PLANNED.name]
    assert {c["variant"] for c in ni} == {"base", "fork"}
    assert all(c["status"] == "not_implemented" and c["reason"] for c in ni)
    assert data["summary"]["exit_status"] == 0
    assert data["summary"]["base_shows_bug_in"] == [
        "spoof-fake-bootstrap-host [mooncake, page 1, base]"]
    assert data["summary"]["not_implemented"] == [PLANNED.name]
    md = (tmp_path / "report.md").read_text()
    assert "| spoof-fake-bootstrap-host |" in md and "**1 leak**" in md and "n/i" in md
    assert "victim-0 x16" in md
    assert "leak_matrix.png" in data["plots"]
    assert (tmp_path / "leak_matrix.png").stat().st_size > 1000


def test_fork_leak_sets_exit_status(tmp_path: Path) -> None:
    rep = rpt.write_all({"versions": {}, "timing": {}}, _scen(), _cells(fork_leak=True), None,
                        tmp_path)
    assert rep["summary"]["exit_status"] == 1
    assert rep["summary"]["fork_failures"] == [
        "spoof-fake-bootstrap-host [mooncake, page 1, fork]"]


def test_a_failed_operator_check_of_the_fork_sets_exit_status(tmp_path: Path) -> None:
    """An operator-path check (``benchmark.incident``) that failed on the fork is a fork
    failure like a leak; on the base it is reported, not failed."""
    def walked(variant: str, ok: bool) -> rpt.Cell:
        return rpt.Cell("incident-walk", "incident", "mooncake", 1, variant,
                        records=[_rec("victim-V", Outcome.IDENTICAL)],
                        checks=[{"step": "1 first start", "what": "the prefill exits",
                                 "ok": True, "expected": "", "seen": ""},
                                {"step": "2 clamp", "what": "the pairing refusal", "ok": ok,
                                 "expected": "pdsafe: ...", "seen": "HTTP 200"}])
    scen = {"incident-walk": SCENARIOS["incident-walk"].describe()}
    rep = rpt.write_all({"versions": {}, "timing": {}}, scen,
                        [walked("base", False), walked("fork", True)], None, tmp_path)
    assert rep["summary"]["exit_status"] == 0
    assert rep["summary"]["failed_checks"] == [
        "incident-walk [mooncake, page 1, base] step 2 clamp: the pairing refusal"]
    md = (tmp_path / "report.md").read_text()
    assert "## Operator-path checks" in md and "**FAILED** step 2 clamp" in md
    assert "2 checks ok" in md and "**1 of 2 checks failed**" in md
    rep = rpt.write_all({"versions": {}, "timing": {}}, scen, [walked("fork", False)], None,
                        tmp_path)
    assert rep["summary"]["exit_status"] == 1
    assert rep["summary"]["fork_failures"] == [
        "incident-walk [mooncake, page 1, fork]: 1 operator-path check(s) failed"]


def test_fork_leak_in_overhead_bursts_sets_exit_status() -> None:
    overhead = {"status": "measured", "content": {"fork": {"sent": 4, "leak": 0, "hang": 1},
                                                  "base": {"sent": 4, "leak": 2}}}
    s = rpt.summarize([c.to_json() for c in _cells()], _scen(), overhead)
    assert s["exit_status"] == 1 and "overhead bursts (fork)" in s["fork_failures"]
    assert s["totals"]["base"]["leaks"] == 3


def test_percentile() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)


def test_overhead_ratios_per_rep_and_pooled(tmp_path: Path) -> None:
    bursts = []
    for rep, (bf, ff) in enumerate(((1.0, 1.1), (1.0, 1.3))):
        bursts.append(Burst("base", rep, "steady", 4, 4, 1.0, 100, [bf] * 4, [0.01] * 10))
        bursts.append(Burst("fork", rep, "steady", 4, 4, 1.25, 100, [ff] * 4, [0.02] * 10))
    s = summarize(bursts, ["steady"])["steady"]
    tp = s["ratios"]["throughput_tok_s"]
    assert tp["mean"] == pytest.approx(0.8) and tp["n"] == 2
    ttft = s["ratios"]["ttft_p50_s"]
    assert (ttft["min"], ttft["max"]) == (pytest.approx(1.1), pytest.approx(1.3))
    assert ttft["stdev"] > 0
    assert s["ratios"]["itl_p50_s"]["mean"] == pytest.approx(2.0)
    assert s["pooled"]["throughput_tok_s"] == pytest.approx(0.8)
    oh = {"status": "measured", "workloads": ["steady"], "steady": s, "sweep": {},
          "samples": {"base": {"ttft_s": [1.0], "itl_s": [0.01]},
                      "fork": {"ttft_s": [1.2], "itl_s": [0.02]}},
          "content": {}}
    rep = rpt.write_all({"versions": {}, "timing": {}}, _scen(), _cells(), oh, tmp_path)
    assert {"overhead_ratios.png", "latency_distribution.png"} <= set(rep["plots"])
    assert "| steady | 2 |" in (tmp_path / "report.md").read_text()


def test_registry_documents_every_scenario() -> None:
    for s in SCENARIOS.values():
        d = s.describe()
        assert len(d["doc"]) > 40, s.name
        if s.implemented:
            assert "leak" in d["doc"].lower(), f"{s.name}: say what a leak looks like"
        else:
            assert d["status"] == "not_implemented" and d["reason"], s.name
    families = {s.family for s in SCENARIOS.values()}
    assert {"steady", "over-capacity", "spoof", "room", "divergence", "abort", "late-write",
            "crash", "corruption"} <= families
    for name in ("steady-state", "spoof-fake-bootstrap-host", "room-replay"):
        assert applicable(SCENARIOS[name], deployment=True)[0]
    assert not applicable(SCENARIOS["divergence-auto-truncate"], deployment=True)[0]
    assert not applicable(SCENARIOS["over-capacity-deployed"], deployment=False)[0]
    with pytest.raises(KeyError):
        select(["no-such-scenario"])
