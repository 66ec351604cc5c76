"""The named hook API guard and the startup self-check (``sglang.pdsafe.hook_api``), no servers.

A hook that fails because upstream changed shape must be its own counter and an ERROR naming
the hook, not an ordinary failure; a PD server whose upstream lacks a hook target must refuse to
start, naming every missing member.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
from sglang.pdsafe import hook_api, metrics
from sglang.pdsafe.hook_api import HookAPIError, Requirement, guarded

FAILED = "peer_release_notify_failed_total"
MISMATCH = hook_api.MISMATCH_COUNTER
_names = itertools.count()


def _hook_name() -> str:
    """A fresh hook name per case: the guard rate-limits its log per hook name."""
    return f"test_hook_api.hook_{next(_names)}"


def _counts() -> tuple[float, float]:
    return metrics.value(MISMATCH), metrics.value(FAILED)


class FakeManager:
    """A stand-in upstream class: the self-check must find what it has and what it lacks."""

    kind = "prefill"

    def present(self, bootstrap_room: int) -> int:
        return bootstrap_room

    def two_args(self, bootstrap_room: int, message: str) -> None:
        return None

    @staticmethod
    def static(x: int) -> int:
        return x


def test_mismatch_counter_is_declared_with_operator_help():
    help_text = metrics.COUNTERS[MISMATCH]
    assert "reinstall" in help_text and "upstream" in help_text


@pytest.mark.parametrize("exc", [
    AttributeError("'CommonKVManager' object has no attribute 'pdsafe_decode_endpoints'"),
    ImportError("cannot import name 'KVPoll'"),
    NameError("name 'KVPoll' is not defined"),
])
def test_guard_counts_an_upstream_shape_change_as_a_mismatch(exc, caplog):
    name = _hook_name()

    @guarded(name, FAILED, default="upstream-default")
    def hook() -> str:
        raise exc

    m0, f0 = _counts()
    with caplog.at_level(logging.ERROR, logger="sglang.pdsafe.hook_api"):
        assert hook() == "upstream-default"
    assert _counts() == (m0 + 1, f0), "a shape change must not count as an ordinary failure"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and name in errors[0].getMessage() and "mismatch" in errors[0].getMessage()
    assert "reinstall" in errors[0].getMessage()


def test_guard_counts_a_signature_type_error_as_a_mismatch():
    def upstream_method(bootstrap_room: int) -> None:  # upstream dropped a parameter
        return None

    @guarded(_hook_name(), FAILED, default=None)
    def hook() -> None:
        upstream_method(1, "reason")

    m0, f0 = _counts()
    assert hook() is None
    assert _counts() == (m0 + 1, f0)


def test_guard_counts_other_errors_on_the_hook_failure_counter(caplog):
    name = _hook_name()

    @guarded(name, FAILED, default=False)
    def hook(x: int) -> bool:
        raise ValueError(f"bad value {x}")

    m0, f0 = _counts()
    with caplog.at_level(logging.ERROR, logger="sglang.pdsafe.hook_api"):
        assert hook(3) is False
    assert _counts() == (m0, f0 + 1)
    rec = next(r for r in caplog.records if name in r.getMessage())
    assert rec.exc_info is not None, "an ordinary failure is logged with its traceback"


def test_guard_counts_a_plain_type_error_as_an_ordinary_failure():
    @guarded(_hook_name(), FAILED, default=None)
    def hook() -> None:
        _ = None + 1  # a bug of ours, not upstream's signature

    m0, f0 = _counts()
    assert hook() is None
    assert _counts() == (m0, f0 + 1)


def test_guard_passes_results_through_and_never_swallows_base_exceptions():
    @guarded(_hook_name(), FAILED, default=None)
    def hook(a: int, *, b: int) -> int:
        return a + b

    assert hook(1, b=2) == 3
    assert hook.__name__ == "hook" and hook.__pdsafe_hook__.startswith("test_hook_api.")

    @guarded(_hook_name(), FAILED, default=None)
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()


def test_guard_refuses_an_undeclared_failure_counter():
    with pytest.raises(KeyError):
        guarded("h", "no_such_counter_total", default=None)


def test_peer_release_hook_counts_a_missing_named_method_as_a_mismatch():
    """Finding 5: the old ``_hook`` counted this AttributeError as notify_failed."""
    from sglang.pdsafe import peer_release

    kv_mgr = SimpleNamespace(disaggregation_mode="prefill")  # lacks pdsafe_room_status
    m0, f0 = _counts()
    assert peer_release.prefill_rejected(kv_mgr, 12345, "over capacity") is None
    assert _counts() == (m0 + 1, f0)


def _fake_reqs() -> list[Requirement]:
    target = f"{__name__}.FakeManager"
    return [
        Requirement(target, ("present(bootstrap_room)", "two_args(bootstrap_room, message)",
                             "static(x)", "kind"), "what exists", "test"),
        Requirement(target, ("absent_method(bootstrap_room)", "absent_attr"),
                    "what does not exist", "test"),
        Requirement(target, ("present(bootstrap_room, endpoints, message)", "kind()"),
                    "wrong signature / not callable", "test"),
        Requirement("sglang.pdsafe.no_such_module.Thing", ("x",), "a moved module", "test"),
        Requirement(f"{__name__}.NoSuchClass", ("y()",), "a renamed class", "test"),
    ]


def test_self_check_lists_every_missing_member_with_why_and_remedy():
    with pytest.raises(HookAPIError) as ei:
        hook_api.self_check(SimpleNamespace(disaggregation_mode="decode"), reqs=_fake_reqs())
    text = str(ei.value)
    for needle in ("FakeManager.absent_method(bootstrap_room) (missing)",
                   "FakeManager.absent_attr (missing)",
                   "FakeManager.present(bootstrap_room, endpoints, message) (signature",
                   "FakeManager.kind() (not callable",
                   "sglang.pdsafe.no_such_module.Thing (cannot import",
                   "NoSuchClass (cannot import", "what does not exist", "a moved module",
                   "reinstall the fork wheel"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    assert "two_args" not in text and "static" not in text, text
    assert text.count(" - needed by ") == 6, text
    assert isinstance(ei.value, RuntimeError)


def test_self_check_passes_when_everything_exists():
    hook_api.self_check(SimpleNamespace(disaggregation_mode="prefill"), reqs=_fake_reqs()[:1])


@pytest.mark.parametrize("enum", [False, True])
def test_self_check_is_a_no_op_outside_pd(enum):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mode = DisaggregationMode.NULL if enum else "null"
    hook_api.self_check(SimpleNamespace(disaggregation_mode=mode), reqs=_fake_reqs())


def test_self_check_checks_when_the_mode_cannot_be_read():
    with pytest.raises(HookAPIError):
        hook_api.self_check(SimpleNamespace(), reqs=_fake_reqs())


def test_pdsafe_modules_declare_the_named_api_they_call():
    from sglang.pdsafe import peer_notifier, peer_release  # noqa: F401 - declare at import

    declared = {(r.target, a) for r in hook_api.requirements() for a in r.attrs}
    kv = "sglang.srt.disaggregation.common.conn.CommonKVManager"
    for attr in ("pdsafe_decode_endpoints(bootstrap_room)",
                 "pdsafe_send_failed_status(bootstrap_room, endpoints, message)",
                 "pdsafe_forget_room(bootstrap_room)", "pdsafe_room_status(bootstrap_room)",
                 "record_failure(bootstrap_room, failure_reason)",
                 "update_status(bootstrap_room, status)", "pdsafe_on_abort_message(msg)"):
        assert (kv, attr) in declared, attr
    assert all(m in hook_api.DECLARING_MODULES
               for m in ("sglang.pdsafe.peer_release", "sglang.pdsafe.peer_notifier"))


def test_self_check_passes_on_the_installed_fork():
    """The real installed sglang has every member the pdsafe modules declare."""
    hook_api.self_check(SimpleNamespace(disaggregation_mode="prefill"))
    hook_api.self_check(SimpleNamespace(disaggregation_mode="decode"))
