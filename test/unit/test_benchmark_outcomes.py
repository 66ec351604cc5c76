"""The benchmark's outcome classifier, canary attribution and transfer evidence (no server).

The benchmark (benchmark/) judges every PD answer against the co-located reference; these tests
pin down the classification rules it reports, so a classifier change that would hide a leak
(e.g. call a 200 with other content an error, or an unproven transfer identical) fails here.
"""

from __future__ import annotations

import random

import pytest
from pdsafe_testkit.metrics import parse_metrics

from benchmark.canary import ALPHABET_SIZE, CanaryBook, alphabet, canary_prompt, owner_of
from benchmark.evidence import Counters, Reservations, counters_from
from benchmark.outcomes import Answer, Outcome, RequestRecord, apply_evidence, classify, count

REF = [10, 11, 12, 13]


@pytest.mark.parametrize(("answer", "expected", "outcome"), [
    (Answer(status=200, output_ids=list(REF)), REF, Outcome.IDENTICAL),
    (Answer(status=200, output_ids=[10, 11, 99, 13]), REF, Outcome.LEAK),
    (Answer(status=200, output_ids=[]), REF, Outcome.LEAK),
    (Answer(status=200, output_ids=REF[:3]), REF, Outcome.LEAK),
    (Answer(status=400, message="prompt too long"), REF, Outcome.EXPLICIT_ERROR),
    (Answer(status=503, message=""), REF, Outcome.BROKEN),
    (Answer(status=None, timed_out=True), REF, Outcome.HANG),
    (Answer(status=None, transport_error="ConnectionError: reset"), REF, Outcome.BROKEN),
    (Answer(status=200, output_ids=[1], in_band_abort=True, message="coverage mismatch"), REF,
     Outcome.EXPLICIT_ERROR),
    (Answer(status=200, output_ids=[], in_band_abort=True, message=""), REF, Outcome.BROKEN),
    (Answer(status=200, output_ids=list(REF)), None, Outcome.BROKEN),
])
def test_classify(answer: Answer, expected: list[int] | None, outcome: Outcome) -> None:
    got, detail = classify(answer, expected)
    assert got is outcome, (got, detail)
    if outcome is not Outcome.IDENTICAL:
        assert detail


def test_classify_never_calls_other_content_identical_or_an_error() -> None:
    rng = random.Random(1)
    for _ in range(200):
        out = [rng.randrange(4, 20) for _ in range(4)]
        got, _ = classify(Answer(status=200, output_ids=out), REF)
        assert got is (Outcome.IDENTICAL if out == REF else Outcome.LEAK)


def _rec(label: str, outcome: Outcome) -> RequestRecord:
    return RequestRecord(label, "router", 32, 4, outcome, phase="p")


def test_apply_evidence_charges_the_shortfall_to_identical_answers_only() -> None:
    recs = [_rec("a", Outcome.IDENTICAL), _rec("b", Outcome.LEAK), _rec("c", Outcome.IDENTICAL),
            _rec("d", Outcome.IDENTICAL)]
    assert apply_evidence(recs, proven=1) == 2
    assert [r.outcome for r in recs] == [Outcome.IDENTICAL, Outcome.LEAK, Outcome.UNPROVEN,
                                         Outcome.UNPROVEN]
    assert "only 1 transfer" in recs[3].detail
    recs2 = [_rec("a", Outcome.IDENTICAL)]
    assert apply_evidence(recs2, proven=5) == 0 and recs2[0].outcome is Outcome.IDENTICAL


def test_count_has_every_class() -> None:
    c = count([_rec("a", Outcome.LEAK), _rec("b", Outcome.LEAK), _rec("c", Outcome.HANG)])
    assert c["sent"] == 3 and c["leak"] == 2 and c["hang"] == 1
    assert set(c) == {o.value for o in Outcome} | {"sent"}


def test_canary_alphabets_are_disjoint_and_attribute_foreign_tokens() -> None:
    vocab = 512
    book = CanaryBook(vocab)
    rng = random.Random(0)
    owners = {}
    for label in ("victim", "attacker"):
        owner, prompt = book.prompt(rng, label, 64)
        owners[label] = owner
        assert all(owner_of(t, vocab) == owner for t in prompt)
        assert len(set(prompt[-16:])) >= 2
    assert owners["victim"] != owners["attacker"]
    assert not set(alphabet(owners["victim"])) & set(alphabet(owners["attacker"]))
    victim_tok = alphabet(owners["victim"])[3]
    own_tok = alphabet(owners["attacker"])[0]
    unused_tok = alphabet(owners["attacker"] + 5)[0]
    att = book.attribute([victim_tok, victim_tok, own_tok, unused_tok, 0], owners["attacker"])
    assert att.foreign == {"victim": 2}
    assert att.own == 1 and att.unattributed == 2
    assert att.sources == ["victim"]
    assert "victim x2" in att.describe()


def test_canary_book_names_every_user_of_a_reused_alphabet() -> None:
    book = CanaryBook(4 + 2 * ALPHABET_SIZE)  # two alphabets only
    assert book.n_owners == 2
    for label in ("r0", "r1", "r2"):
        book.take(label)
    tok = alphabet(0)[0]
    att = book.attribute([tok], own_owner=1)
    assert list(att.foreign) == ["alphabet 0: r2|r0"]


def test_canary_prompt_is_deterministic() -> None:
    assert canary_prompt(random.Random(3), 5, 40) == canary_prompt(random.Random(3), 5, 40)


METRICS_P = """
# HELP sglang:kv_transfer_total_mb Histogram of KV cache transfer size in MB.
sglang:kv_transfer_total_mb_count{model_name="m"} 7.0
sglang:kv_transfer_total_mb_sum{model_name="m"} 0.5
sglang:num_transfer_failed_reqs_total{model_name="m"} 1.0
sglang:pdsafe_coverage_mismatch_total 2.0
"""
METRICS_D = """
sglang:per_stage_req_latency_seconds_count{model_name="m",stage="decode_transferred"} 5.0
sglang:per_stage_req_latency_seconds_count{model_name="m",stage="decode_waiting"} 9.0
sglang:num_decode_deferred_kv_release_reqs{model_name="m"} 0.0
"""


def test_transfer_evidence_is_the_smaller_side() -> None:
    c = counters_from(parse_metrics(METRICS_P), parse_metrics(METRICS_D))
    assert (c.decode_commits, c.prefill_sends, c.transfer_failed) == (5.0, 7.0, 1.0)
    assert c.proven == 5
    assert dict(c.pdsafe) == {"sglang:pdsafe_coverage_mismatch_total": 2.0}
    d = c.minus(Counters(decode_commits=4.0, prefill_sends=2.0))
    assert d.proven == 1 and d.to_json()["proven"] == 1


def test_reservations_clean_only_when_nothing_is_held() -> None:
    r = Reservations(decode_used_tokens=0, decode_pages=0, prefill_used_tokens=0, prefill_pages=0,
                     decode_prealloc_queue=0, decode_transfer_queue=0, decode_retracted_queue=0,
                     decode_deferred_release=0, prefill_bootstrap_queue=0,
                     prefill_inflight_queue=0)
    assert r.clean and r.pages_reserved == 0
    r.decode_transfer_queue = 1
    assert not r.clean and r.to_json()["requests_parked"] == 1
    assert Reservations().pages_reserved is None and not Reservations().clean
