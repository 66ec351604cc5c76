"""Transfer generations end to end (issue 9, item 2): a room's stale status messages cannot
touch its live transfer.

The shared PD stack's prefill runs the test-only fault ``stale_status`` (conftest; it acts only
on bootstrap rooms of its reserved range, ``pdsafe_testkit.faults.stale_room``). When the
decode's metadata for such a room reaches the prefill, the prefill first sends that decode
endpoint what an earlier transfer of the same room could still have in flight (a late message
of a finished or aborted request that used the room, or one a client replays): ``Failed``
without a transfer generation, ``Failed`` and ``Success`` with another generation. Then the
real transfer runs. The decode must drop all three (``stale_kv_status_dropped_total`` +3) and
answer the co-located reference's tokens, on every backend.

Without patch 0025 the decode takes the stale ``Failed`` for the live transfer's: the request
fails with HTTP 500 and the stale reason (a late message of an earlier request of the room
kills the live one; with a stale ``Success`` and aux data it would commit pages prefill never
wrote, which upstream's metadata gate and the coverage attestation are then left to catch).

What this does not show: stale TCP aux data and CHUNK_READY on servers (the harness runs
neither Mooncake's TCP aux path nor staging; ``test/unit/test_transfer_generation.py`` runs
both on the real decode loops), and TP > 1 (one rank per leg here).
"""

from __future__ import annotations

import random

import pytest
from pdsafe_testkit.faults import ROOM_RANGE_WIDTH, STALE_LOG, stale_room
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import direct_pd_generate

pytestmark = pytest.mark.server

MAX_NEW = 16
DROPPED = "sglang:pdsafe_stale_kv_status_dropped_total"
#: Messages ``stale_status`` sends per request (see the module doc).
STALE_PER_REQUEST = 3


def test_stale_status_messages_of_a_room_never_reach_its_live_transfer(pd, oracle,
                                                                       model_path) -> None:
    rng = random.Random(f"stale-status-{pd.backend}")
    for i in range(2):
        prompt = random_prompt(rng, rng.randint(40, 160), model_path)
        room = stale_room(rng.randrange(ROOM_RANGE_WIDTH))
        before = metric_total(pd.decode.url, DROPPED)
        p, r = direct_pd_generate(pd, prompt, MAX_NEW, room=room)
        assert f"{STALE_LOG}: room {room}: sent {STALE_PER_REQUEST}" in \
            pd.prefill.process.log_text(), "the stale_status fault did not act (proves nothing)"
        oracle.assert_identical(r, prompt, MAX_NEW,
                                what=f"{pd.backend} request {i} after stale status messages "
                                     f"of its room {room}")
        assert p.status == 200, f"{pd.backend} prefill leg: HTTP {p.status}: {p.error_message}"
        dropped = metric_total(pd.decode.url, DROPPED) - before
        assert dropped == STALE_PER_REQUEST, \
            f"{pd.backend}: the decode dropped {dropped} of the {STALE_PER_REQUEST} stale messages"
