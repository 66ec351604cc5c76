"""HTTP admission's prompt-limit logic (``sglang.pdsafe.admission``), no servers: the check the
tokenizer manager runs, and the decode limit that includes the reserved decode tokens.
With real servers: test/admission/test_http_admission.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.pdsafe import admission, limits


def _tm(limit: int | None, truncate: bool) -> SimpleNamespace:
    return SimpleNamespace(max_req_input_len=limit, allow_auto_truncate=truncate,
                           context_len=4096, pdsafe_kv_capacity=512)


@pytest.mark.parametrize("n", [504, 505])
def test_check_input_length_accepts_up_to_limit(n):
    ids = list(range(n))
    admission.check_input_length(_tm(506, False), ids)
    assert len(ids) == n


@pytest.mark.parametrize("n", [506, 507, 4000])
def test_check_input_length_refuses_from_limit(n):
    with pytest.raises(admission.PromptTooLongError) as e:
        admission.check_input_length(_tm(506, False), list(range(n)))
    assert e.value.status_code == 400
    body = admission.error_content(e.value)
    assert body["error"]["prompt_tokens"] == n and body["error"]["max_prompt_tokens"] == 505
    assert "--max-total-tokens" in str(e.value)


def test_check_input_length_truncates_with_allow_auto_truncate():
    """--allow-auto-truncate: the longest prompt the scheduler door accepts, no counter."""
    from sglang.pdsafe import metrics

    before = metrics.value("rejected_over_capacity_http_total")
    ids = list(range(900))
    admission.check_input_length(_tm(506, True), ids)
    assert ids == list(range(505))
    assert metrics.value("rejected_over_capacity_http_total") == before


def test_check_input_length_waits_for_scheduler_limit():
    ids = list(range(10_000))
    admission.check_input_length(_tm(None, False), ids)  # before the scheduler reported
    assert len(ids) == 10_000


def test_decode_limit_includes_reserved_decode_tokens():
    args = SimpleNamespace(disaggregation_mode="decode", num_reserved_decode_tokens=512,
                           disable_radix_cache=False)
    assert limits.pd_input_limit(args, 800, 794, page_size=4) == 289
    assert limits.pd_input_limit(args, 1024, 1018, page_size=1) == 513
    args.disaggregation_mode = "prefill"
    assert limits.pd_input_limit(args, 800, 794, page_size=4) == 794
