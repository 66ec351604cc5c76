"""One place decides PD mode, and it fails closed (issue #7, findings 6 and 10).

``protections.pd_mode`` reads ``disaggregation_mode`` from real upstream ``ServerArgs`` (or the
published ``get_disagg()`` namespace, or an object carrying upstream's ``DisaggregationMode``)
and raises when it cannot tell; ``process_pd_mode`` does the same from the process's published
runtime context. The placeholder guard, which runs inside ``Req.set_finish_with_abort`` without
server arguments at hand, takes the safe side when the mode is unknown: PD, the prompt is kept.
No other pdsafe module reads ``disaggregation_mode`` itself.
"""

from __future__ import annotations

import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang.pdsafe import admission, placeholder_guard, protections
from sglang.pdsafe.protections import PDModeUnknownError, is_pd, pd_mode, process_pd_mode
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_disagg, publish, reset_context
from sglang.srt.server_args import ServerArgs

PDSAFE_DIR = Path(protections.__file__).resolve().parent


@pytest.fixture
def published() -> Iterator[Callable[[str], None]]:
    """Publish real ServerArgs of a given mode in this process; reset afterwards."""

    def _publish(mode: str) -> None:
        publish(ServerArgs(model_path="dummy", disaggregation_mode=mode), role="scheduler")

    reset_context()
    yield _publish
    reset_context()


@pytest.mark.parametrize("mode", ["prefill", "decode", "null"])
def test_pd_mode_reads_real_server_args_and_the_published_namespace(mode, published):
    args = ServerArgs(model_path="dummy", disaggregation_mode=mode)
    assert pd_mode(args) == mode
    assert is_pd(args) is (mode != "null")
    published(mode)
    assert pd_mode(get_disagg()) == mode
    assert process_pd_mode() == mode


def test_pd_mode_reads_upstreams_enum():
    """KV managers and schedulers carry DisaggregationMode, which is not a str Enum: a plain
    ``in ("prefill", "decode")`` test is False for it (one of the variants this replaced)."""
    for member in DisaggregationMode:
        holder = SimpleNamespace(disaggregation_mode=member)
        assert pd_mode(holder) == member.value
    assert DisaggregationMode.PREFILL not in ("prefill", "decode")  # why .value is needed


@pytest.mark.parametrize("args", [
    None,
    SimpleNamespace(),  # no attribute at all
    SimpleNamespace(disaggregation_mode=None),
    SimpleNamespace(disaggregation_mode=""),
    SimpleNamespace(disaggregation_mode="prefil"),
    SimpleNamespace(disaggregation_mode=1),
], ids=["none", "missing", "None", "empty", "typo", "int"])
def test_pd_mode_fails_closed_on_anything_it_cannot_read(args):
    with pytest.raises(PDModeUnknownError):
        pd_mode(args)
    with pytest.raises(PDModeUnknownError):
        is_pd(args)


def test_process_pd_mode_fails_closed_without_a_published_context(published):
    with pytest.raises(PDModeUnknownError, match="not published"):
        process_pd_mode()


class _Req:
    """What record_rejection touches on a Req: it only attaches the typed verdict."""


@pytest.mark.parametrize("mode,rewrite", [("prefill", False), ("decode", False),
                                          ("null", True)])
def test_stub_rewrite_only_on_a_known_non_pd_server(mode, rewrite, published):
    published(mode)
    req = _Req()
    assert placeholder_guard.record_rejection(req, "too long", 400, "BadRequest") is rewrite
    assert placeholder_guard.rejection_of(req) == placeholder_guard.Rejection(
        "too long", 400, "BadRequest")


def test_stub_rewrite_refused_when_the_mode_is_unknown(published, caplog):
    """The fail-open this replaces: an unreadable mode used to mean "not PD" (stub allowed)."""
    req = _Req()
    with caplog.at_level("ERROR", logger=placeholder_guard.logger.name):
        assert placeholder_guard.record_rejection(req, "too long", 400, "BadRequest") is False
    assert placeholder_guard.rejection_of(req).message == "too long"
    assert any("treating this process as PD" in r.getMessage() for r in caplog.records)


def test_protection_report_uses_the_one_decision():
    assert admission.CLAMP_FLAG  # registers pd-capacity-invariant
    for mode in ("prefill", "decode", "null"):
        st = protections.status(ServerArgs(model_path="dummy", disaggregation_mode=mode))
        for name in ("no-placeholder-handoff", "pd-capacity-invariant"):
            assert st.get(name, False) is (mode != "null"), (mode, name)
        assert ("decode-commit-gate" in st) is (mode == "decode")
    with pytest.raises(PDModeUnknownError):
        protections.status(SimpleNamespace())


#: Reads of ``disaggregation_mode`` outside protections.py that their owners have not yet
#: moved to ``protections.pd_mode``/``process_pd_mode`` (file -> how many). Only shrinks.
NOT_YET_CONVERTED: dict[str, int] = {
    "peer_release.py": 1,  # _is_prefill(kv_mgr): kv_mgr.disaggregation_mode
    "peer_notifier.py": 1,  # on_http_undelivered: get_disagg().disaggregation_mode
}


def _mode_reads(path: Path) -> list[str]:
    """Lines of ``path`` that read ``disaggregation_mode`` (a name/attribute, or the string
    literal given to getattr); comments and docstrings do not count."""
    out: list[str] = []
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            hit = (tok.type == tokenize.NAME and tok.string == "disaggregation_mode") or (
                tok.type == tokenize.STRING
                and tok.string.strip("'\"") == "disaggregation_mode")
            if hit:
                out.append(f"{tok.start[0]}: {tok.line.strip()}")
    return out


def test_the_scan_sees_each_way_of_writing_it(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('''"""A docstring naming disaggregation_mode does not count."""
# nor does a comment: disaggregation_mode
a = args.disaggregation_mode
b = getattr(args, "disaggregation_mode", "null")
c = get_disagg().disaggregation_mode
''')
    assert [ln.split(":")[0] for ln in _mode_reads(probe)] == ["3", "4", "5"]


def test_no_other_module_reads_disaggregation_mode():
    """Every PD-mode decision goes through protections.pd_mode (one place, fail closed)."""
    found = {p.name: _mode_reads(p) for p in sorted(PDSAFE_DIR.glob("*.py"))
             if p.name != "protections.py"}
    too_many = {f: lines for f, lines in found.items()
                if len(lines) > NOT_YET_CONVERTED.get(f, 0)}
    assert not too_many, f"PD mode read outside protections.pd_mode: {too_many}"
    assert _mode_reads(PDSAFE_DIR / "protections.py"), "the one place itself must read it"
