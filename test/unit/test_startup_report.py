"""The startup checks and the protection report (``sglang.pdsafe.startup``, patch 0032).

* A PD server whose installed upstream lacks a method the pdsafe hooks call refuses to start
  with the list of what is missing; a co-located server does not need the PD hook targets.
* Each role reports only the protections that apply to it; "OFF" appears only for a
  protection an operator switched off, naming the setting they changed; a protection that
  leans on one switched off is reported as weaker.
* The fake transfer backend refuses a PD start unless waived; the waiver is reported.
* Both hooks (launcher and scheduler) run the same checks; the scheduler reports itself only
  when no launcher ran (smg gRPC, ``--use-ray`` actors without the launcher's state dir).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from sglang.pdsafe import bootstrap_auth, hook_api, policy, protections, startup

SWITCHES = ("SGLANG_PDSAFE_ROOM_GUARD", "SGLANG_PDSAFE_SOURCE_LEASE", "SGLANG_PDSAFE_QUARANTINE",
            "SGLANG_PDSAFE_KV_DIGEST", "SGLANG_PDSAFE_PAGE_GENERATION",
            "SGLANG_PDSAFE_PEER_RELEASE", "SGLANG_PDSAFE_COVERAGE",
            "SGLANG_PDSAFE_PAIR_AGREEMENT", "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS",
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", startup.ENV_WAIVE_FAKE,
            "SGLANG_PDSAFE_WAIVE_UNWIRED_GENERATION")


@pytest.fixture(autouse=True)
def _default_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in SWITCHES:
        monkeypatch.delenv(var, raising=False)
    # A production PD server has a cluster key (without one it reports its control messages
    # unsigned: test_without_a_cluster_key_the_report_says_control_messages_go_unsigned).
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, "k" * 32)


def _args(mode: str, backend: str = "mooncake") -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend=backend)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_server_reports_protections_and_passes_the_self_check(
        mode: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
        status = startup.launching(_args(mode))
    assert status["no-placeholder-handoff"] and all(status.values())
    assert f"{mode} protections active" in caplog.text
    assert _warnings(caplog) == [], "a default PD server must warn about nothing"


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_without_a_cluster_key_the_report_says_control_messages_go_unsigned(
        mode: str, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(bootstrap_auth.ENV_TOKEN)
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        status = startup.report(_args(mode))
    assert status["signed-control-messages"] is False
    (w,) = [w for w in _warnings(caplog) if "signed-control-messages" in w]
    assert "OFF" in w and bootstrap_auth.ENV_TOKEN in w and "--api-key" in w, w


def test_each_role_reports_only_its_own_protections() -> None:
    prefill = protections.status(_args("prefill"))
    decode = protections.status(_args("decode"))
    assert "prefill-source-lease" in prefill and "prefill-source-lease" not in decode
    assert "decode-page-quarantine" in decode and "decode-page-quarantine" not in prefill
    assert "decode-commit-gate" in decode and "decode-commit-gate" not in prefill
    assert "bootstrap-auth" in prefill and "bootstrap-auth" not in decode
    co = protections.status(_args("null"))
    assert set(co) == {"http-input-length-limit", "client-bypass-guard",
                       "client-cache-key-guard"}


def test_a_decode_does_not_report_a_prefill_protection_off(monkeypatch, caplog) -> None:
    """The false alarm: a decode logged 'prefill-source-lease is OFF' (and a prefill the
    quarantine) without anyone switching them off."""
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        startup.report(_args("decode"))
        startup.report(_args("prefill"))
    assert not any("OFF" in w for w in _warnings(caplog)), _warnings(caplog)
    monkeypatch.setenv("SGLANG_PDSAFE_SOURCE_LEASE", "0")  # a prefill switch, on a decode
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        startup.report(_args("decode"))
    assert not any("prefill-source-lease" in w for w in _warnings(caplog))


def test_off_names_the_setting_the_operator_changed(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SGLANG_PDSAFE_QUARANTINE", "off")
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        status = startup.report(_args("decode"))
    assert status["decode-page-quarantine"] is False
    (w,) = [w for w in _warnings(caplog) if "decode-page-quarantine" in w]
    assert "OFF (SGLANG_PDSAFE_QUARANTINE=off, set by the operator)" in w


def test_room_guard_off_warns_that_the_source_lease_is_weaker(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SGLANG_PDSAFE_ROOM_GUARD", "0")
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        status = startup.report(_args("prefill"))
    assert status["bootstrap-room-guard"] is False and status["prefill-source-lease"] is True
    weaker = [w for w in _warnings(caplog) if "weaker" in w]
    assert len(weaker) == 1 and "'prefill-source-lease' is weaker" in weaker[0]
    assert "SGLANG_PDSAFE_ROOM_GUARD=0" in weaker[0]


def test_missing_hook_target_refuses_pd_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    monkeypatch.delattr(CommonKVManager, "pdsafe_send_failed_status")
    for hook in (startup.launching, startup.scheduler_starting):
        with pytest.raises(hook_api.HookAPIError, match="pdsafe_send_failed_status"):
            hook(_args("decode"))
    startup.launching(_args("null"))  # co-located: no PD hook targets needed


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_the_fake_transfer_backend_refuses_a_pd_start(mode: str) -> None:
    for hook in (startup.launching, startup.scheduler_starting):
        with pytest.raises(startup.FakeTransferRefusedError, match="pages nobody wrote"):
            hook(_args(mode, backend="fake"))
    startup.launching(_args("null", backend="fake"))  # not PD: nothing to refuse


def test_the_fake_transfer_waiver_is_reported_and_served_requests_are_counted(
        monkeypatch, caplog) -> None:
    monkeypatch.setenv(startup.ENV_WAIVE_FAKE, "1")
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        status = startup.launching(_args("decode", backend="fake"))
    assert all(status[n] is False for n in startup.FAKE_TRANSFER_OFF if n in status)
    text = "\n".join(_warnings(caplog))
    assert startup.ENV_WAIVE_FAKE in text and "kv-digest" in text and "coverage" in text
    assert "zeroes their pages" in text  # test_kv_integrity_wiring shows the zeroing


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_backend_without_the_transfer_generation_refuses_a_pd_start(
        mode: str, monkeypatch, caplog) -> None:
    """A backend whose messages carry no transfer generation: its rows would bind generation
    0, so a stale row of the same room and range would verify. Refused at start (launcher and
    scheduler); waived only explicitly, then warned, reported off and gauged. No backend of
    this release is unwired (MORI was until patch 0034; test_mori_control_messages.py shows it
    starts now, and that an unwired manager class is refused from the class alone): the
    mechanism is shown on MORI listed as unwired, as it was."""
    from sglang.pdsafe import metrics, transfer_generation

    monkeypatch.setattr(transfer_generation, "UNWIRED_BACKENDS", frozenset({"mori"}))
    for hook in (startup.launching, startup.scheduler_starting):
        with pytest.raises(transfer_generation.UnwiredGenerationError,
                           match="does not carry the transfer generation"):
            hook(_args(mode, backend="mori"))
    startup.launching(_args("null", backend="mori"))  # not PD: nothing to refuse
    for backend in ("mooncake", "nixl", "ascend"):
        transfer_generation.check_backend(_args(mode, backend=backend))
        assert metrics.value(transfer_generation.UNWIRED_GAUGE) == 0
    monkeypatch.setenv(transfer_generation.ENV_WAIVE_UNWIRED, "1")
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        status = startup.launching(_args(mode, backend="mori"))
    assert status["transfer-generation"] is False
    assert metrics.value(transfer_generation.UNWIRED_GAUGE) == 1
    text = "\n".join(_warnings(caplog))
    assert transfer_generation.ENV_WAIVE_UNWIRED in text and "generation 0" in text


def test_the_launcher_creates_the_state_dir_the_schedulers_share(monkeypatch) -> None:
    monkeypatch.delenv(policy.ENV_STATE_DIR, raising=False)
    startup.launching(_args("prefill"))
    first = policy.state_dir()
    assert first is not None
    startup.launching(_args("prefill"))  # idempotent within one launcher
    assert policy.state_dir() == first


def test_the_scheduler_reports_only_when_no_launcher_did(monkeypatch, caplog) -> None:
    monkeypatch.delenv(policy.ENV_STATE_DIR, raising=False)
    with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
        startup.scheduler_starting(_args("decode"))  # --use-ray: no launcher hook ran
    assert "decode protections active" in caplog.text
    caplog.clear()
    monkeypatch.setenv(policy.ENV_STATE_DIR, "/tmp/launched")
    with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
        startup.scheduler_starting(_args("decode"))
    assert "protections active" not in caplog.text


def test_a_scheduler_behind_smg_grpc_reports_itself(monkeypatch, caplog) -> None:
    """The smg gRPC servicer launches its schedulers without Engine._launch_subprocesses: the
    scheduler logs the report itself, co-located too (a co-located HTTP server's launcher
    reports, so its scheduler does not)."""
    monkeypatch.delenv(policy.ENV_STATE_DIR, raising=False)
    monkeypatch.delenv("SMG_SGLANG_ZMQ_HANDSHAKE", raising=False)
    for grpc, reported in ((True, True), (False, False)):
        args = SimpleNamespace(disaggregation_mode="null", disaggregation_transfer_backend="",
                               smg_grpc_mode=grpc, grpc_mode=False)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
            startup.scheduler_starting(args)
        assert ("co-located server protections active" in caplog.text) is reported, grpc


def test_a_bad_poison_threshold_refuses_the_start(monkeypatch) -> None:
    monkeypatch.setenv(policy.ENV_POISON_AFTER, "0")
    with pytest.raises(ValueError, match=policy.ENV_POISON_AFTER):
        startup.scheduler_starting(_args("prefill"))
