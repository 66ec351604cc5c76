"""The named hook API and the startup self-check (``sglang.pdsafe.hook_api``), no servers.

A hook that fails because upstream changed shape must be its own counter (the failure policy's
guard, ``test_policy.py``, counts it there), not an ordinary failure; a PD server whose upstream
lacks a hook target must refuse to start, naming every missing member.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.pdsafe import hook_api, metrics, startup
from sglang.pdsafe.hook_api import HookAPIError, Requirement

FAILED = "peer_release_notify_failed_total"
MISMATCH = hook_api.MISMATCH_COUNTER


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


@pytest.mark.parametrize("exc,mismatch", [
    (AttributeError("'CommonKVManager' object has no attribute 'pdsafe_decode_endpoints'"), True),
    (ImportError("cannot import name 'KVPoll'"), True),
    (NameError("name 'KVPoll' is not defined"), True),
    (TypeError("present() takes 2 positional arguments but 3 were given"), True),
    (TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'"), False),
    (ValueError("bad value"), False),
])
def test_is_mismatch_tells_an_upstream_shape_change_from_a_bug(exc, mismatch):
    assert hook_api.is_mismatch(exc) is mismatch


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
    assert all(m in startup.HOOK_MODULES
               for m in ("sglang.pdsafe.peer_release", "sglang.pdsafe.peer_notifier"))


def test_self_check_passes_on_the_installed_fork():
    """The real installed sglang has every member the pdsafe modules declare."""
    hook_api.self_check(SimpleNamespace(disaggregation_mode="prefill"),
                        modules=startup.HOOK_MODULES)
    hook_api.self_check(SimpleNamespace(disaggregation_mode="decode"),
                        modules=startup.HOOK_MODULES)
