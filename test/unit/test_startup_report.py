"""The startup hook (patch 0004): the protections report and the hook-API self-check.

A PD server whose installed upstream lacks a method the pdsafe hooks call must refuse to start
with the list of what is missing; a co-located server does not need the PD hook targets; the
installed fork has every target its modules declare.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from sglang.pdsafe import hook_api, protections


def _args(mode: str) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_server_reports_protections_and_passes_the_self_check(
        mode: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
        status = protections.log_startup(_args(mode))
    assert status["decode-commit-gate"] and status["no-placeholder-handoff"]
    assert "protections active" in caplog.text


def test_missing_hook_target_refuses_pd_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    monkeypatch.delattr(CommonKVManager, "pdsafe_send_failed_status")
    with pytest.raises(hook_api.HookAPIError, match="pdsafe_send_failed_status"):
        protections.log_startup(_args("decode"))
    protections.log_startup(_args("null"))  # co-located: no PD hook targets needed
