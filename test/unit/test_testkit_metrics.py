"""The testkit's one /metrics reader (``pdsafe_testkit.metrics``), on exposition text as
prometheus_client writes it: exact names, label filters, escapes, absent metrics."""

from __future__ import annotations

import math

import pytest
from pdsafe_testkit.metrics import parse_metrics, sum_samples

TEXT = r"""# HELP sglang:pdsafe_peer_notified_release_total Requests whose peer was told.
# TYPE sglang:pdsafe_peer_notified_release_total counter
sglang:pdsafe_peer_notified_release_total 3.0
sglang:pdsafe_peer_notified_release_created 1.7e9
sglang:http_requests_total{endpoint="/generate",method="POST",status="200"} 5.0
sglang:http_requests_total{endpoint="/generate",method="POST",status="400"} 2.0
sglang:http_requests_total{endpoint="/health",method="GET",status="200"} 40.0
sglang:num_requests_total{model_name="m \"q\", x=1"} 7.0
sglang:ttft_bucket{le="+Inf"} +Inf 1700000000000

sglang:nan_gauge NaN
"""


def test_sums_exact_names_over_label_sets() -> None:
    samples = parse_metrics(TEXT)
    assert sum_samples(samples, "sglang:pdsafe_peer_notified_release_total") == 3.0
    # Never the ..._created sample, nor a prefix match.
    assert sum_samples(samples, "sglang:pdsafe_peer_notified_release") == 0.0
    assert sum_samples(samples, "sglang:http_requests_total") == 47.0
    assert sum_samples(samples, "sglang:http_requests_total", endpoint="/generate") == 7.0
    assert sum_samples(samples, "sglang:http_requests_total", endpoint="/generate",
                       status="400") == 2.0
    assert sum_samples(samples, ("sglang:num_requests_total",
                                 "sglang:pdsafe_peer_notified_release_total")) == 10.0
    assert sum_samples(samples, "sglang:absent_total") == 0.0


def test_labels_values_and_timestamps() -> None:
    by_name = {s.name: s for s in parse_metrics(TEXT)}
    assert by_name["sglang:num_requests_total"].label("model_name") == 'm "q", x=1'
    assert by_name["sglang:ttft_bucket"].value == math.inf
    assert by_name["sglang:ttft_bucket"].label("le") == "+Inf"
    assert math.isnan(by_name["sglang:nan_gauge"].value)


@pytest.mark.parametrize("bad", ["sglang:x{a=1} 2.0", "sglang:x", "1abc 2.0"])
def test_malformed_lines_raise(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_metrics(bad)
