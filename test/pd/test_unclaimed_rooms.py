"""A request sent to a decode alone is answered within a bound, and its pages are released
(issue 21, item 4; ``sglang.pdsafe.unclaimed_rooms``).

Stock 0.5.23: the decode reserves pages, sends their addresses to the prefill named by the
request's ``bootstrap_host``, and waits for a transfer that no request on that prefill will ever
make; its client gets no answer until upstream's waiting timeout (300 s by default), and the
reservation stalls the pair meanwhile. With sglang-pdsafe the prefill drops metadata that no
request of its room claims within ``SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S`` (10 s on the
shared test stacks), and tells the decode: the client gets HTTP 400 naming the variable, the
decode holds nothing afterwards, and the room's own prefill request, if it arrives later, is
refused at once (it would find no metadata). Releasing is safe because the prefill, the only
process that received the page addresses, forgot them before it answered: the content check
is that the pair's next answers are reference-identical.

Server-free checks of the same logic (the real Mooncake and NIXL KV managers, the flood
bound): test/unit/test_unclaimed_rooms.py.
"""

from __future__ import annotations

import random
import time

import pytest
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import decode_idle, generate

server = pytest.mark.server

MAX_NEW = 12
DROPPED = "sglang:pdsafe_prefill_unclaimed_room_dropped_total"
#: The shared stacks' SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S (test/conftest.py), and the slack
#: a loaded 2-core machine needs on top of it to answer.
TIMEOUT_S = 10.0
SLACK_S = 15.0


@server
def test_a_request_sent_to_the_decode_alone_is_answered_and_released(pd, oracle, model_path):
    if pd.backend not in ci_backends():
        # The drop and the Failed answer run in the common KV layer; NIXL's manager runs them
        # in test/unit/test_unclaimed_rooms.py (PDSAFE_FULL_BACKENDS=all runs this one too).
        pytest.skip(f"{pd.backend}: not in this run's backends (CI time)")
    rng = random.Random(2112)
    assert not any(decode_idle(pd.decode, 10).values()), "the decode is not idle before the test"
    ids = random_prompt(rng, 80, model_path)
    room = rng.randrange(1 << 62)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.prefill.bootstrap_port,
            "bootstrap_room": room}
    dropped0 = pd.prefill.metric(DROPPED)

    t0 = time.monotonic()
    r = generate(pd.decode.url, ids, MAX_NEW, timeout=TIMEOUT_S + SLACK_S + 30, **boot)
    waited = time.monotonic() - t0
    assert r.status == 400, f"expected 400 for a room no prefill request claims: {r.status} " \
                            f"{r.body!r:.300}"
    assert waited <= TIMEOUT_S + SLACK_S, f"answered only after {waited:.1f}s"
    assert "SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S" in r.error_message, r.error_message
    assert not r.output_ids, "an error must carry no tokens"
    # The room's own prefill request, arriving late (within the one timeout the prefill
    # remembers the dropped room), is refused at once: its metadata is gone.
    late = generate(pd.prefill.url, ids, MAX_NEW, timeout=30, **boot)
    assert late.status >= 400 and not late.output_ids, (late.status, late.body)
    held = decode_idle(pd.decode, 10)
    assert not any(held.values()), f"the decode still holds the reservation: {held}"
    assert pd.prefill.metric(DROPPED) >= dropped0 + 1, "the drop was not counted"

    # The pair serves on, reference-identical (content, not status codes).
    prompts = [random_prompt(rng, rng.randint(40, 120), model_path) for _ in range(3)]
    for p in prompts:
        oracle.expected(p, MAX_NEW)
    for p in prompts:
        oracle.assert_identical(generate(pd.router.url, p, MAX_NEW, timeout=120), p, MAX_NEW)
    print(f"{pd.backend}: decode-only request answered {r.status} after {waited:.1f}s "
          f"(timeout {TIMEOUT_S:g}s); reservation released")
