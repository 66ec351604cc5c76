"""The client guard's logic (``sglang.pdsafe.client_guard``), no servers: its reserved values
are upstream's, and only server-built requests may carry them.
With real servers: test/admission/test_client_guard.py."""

from __future__ import annotations

from typing import Any

import pytest
from sglang.pdsafe import client_guard
from sglang.pdsafe.client_guard import FAKE_BOOTSTRAP_HOST as FAKE


def test_guard_constants_match_upstream():
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    assert client_guard.FAKE_BOOTSTRAP_HOST == FAKE_BOOTSTRAP_HOST
    assert client_guard.HEALTH_CHECK_RID_PREFIX == HEALTH_CHECK_RID_PREFIX


class _Req:
    def __init__(self, path: str = "/generate", method: str = "POST",
                 headers: dict | None = None) -> None:
        self.url = type("U", (), {"path": path})()
        self.method = method
        self.headers = headers or {}


class _Obj:
    def __init__(self, host: Any = None, rid: Any = None) -> None:
        self.bootstrap_host, self.rid = host, rid


def test_guard_trusts_only_server_built_requests():
    spoof = _Obj(host=FAKE, rid="HEALTH_CHECK_1")
    with client_guard.server_internal():  # the server's own warmups (execute_warmups)
        client_guard.check_client_request(spoof, None)
    # An in-process caller that passes no HTTP request (the offline Engine, the gRPC bridge)
    # is a client like any other: no request object is no proof the server built it.
    with pytest.raises(client_guard.SpoofedInternalFieldError):
        client_guard.check_client_request(spoof, None)
    client_guard.check_client_request(spoof, _Req("/health_generate", "GET"))
    client_guard.check_client_request(spoof, _Req(headers=client_guard.internal_headers()))
    for req in (_Req(), _Req("/health_generate", "POST"),
                _Req(headers={client_guard.INTERNAL_HEADER: "guess"})):
        with pytest.raises(client_guard.SpoofedInternalFieldError):
            client_guard.check_client_request(spoof, req)
    client_guard.check_client_request(_Obj(host=["127.0.0.1", None], rid=["a", None]), _Req())


@pytest.mark.parametrize("hashes", [["ab" * 32], [["ab" * 32], None], [None, ["cd" * 32]]])
def test_client_mm_hashes_are_refused_400_and_counted(monkeypatch, hashes: Any) -> None:
    """A client-chosen mm_hashes (single or batch form) is refused before anything keys a cache
    with it; the server's own requests and requests without one pass; the operator's explicit
    trust lets them through and the startup report names the setting."""
    from sglang.pdsafe import metrics, protections
    from sglang.srt.managers.io_struct import GenerateReqInput

    monkeypatch.delenv(client_guard.ENV_TRUST_MM_HASHES, raising=False)
    obj = GenerateReqInput(input_ids=[1, 2, 3], mm_hashes=hashes)
    before = metrics.value(client_guard.CLIENT_MM_HASHES)
    with pytest.raises(client_guard.ClientCacheKeyError) as e:
        client_guard.check_client_request(obj, _Req())
    assert e.value.status_code == 400 and "mm_hashes" in str(e.value)
    assert client_guard.ENV_TRUST_MM_HASHES in str(e.value), "the message names no remedy"
    assert metrics.value(client_guard.CLIENT_MM_HASHES) == before + 1
    client_guard.check_client_request(GenerateReqInput(input_ids=[1], mm_hashes=None), _Req())
    client_guard.check_client_request(GenerateReqInput(input_ids=[1], mm_hashes=[None]), _Req())
    with client_guard.server_internal():
        client_guard.check_client_request(obj, None)
    guard = next(p for p in protections.registered() if p.name == "client-cache-key-guard")
    assert guard.switched_off(None) is None
    monkeypatch.setenv(client_guard.ENV_TRUST_MM_HASHES, "1")
    client_guard.check_client_request(obj, _Req())
    assert guard.switched_off(None) == f"{client_guard.ENV_TRUST_MM_HASHES}=1"
