"""A process on the loopback network without the cluster key attacks a keyed PD pair while real
traffic flows (issue 21, items 2 and 7; ``sglang.pdsafe.control_mac``), on Mooncake and NIXL.

The shared stacks run with a cluster key (``pdsafe_testkit.servers.server_env``), so every
server test of the suite runs signed: their reference-identical answers are the check that
signing breaks nothing. Here the attacker reads the prefill rank's ZMQ address from the public
``GET /route`` and, while a request of room R is in flight, pushes what a decode would send to
name R (an announcement of this wire version, a registration of its own transport identity and
page addresses, metadata for R with a made-up generation, and ABORTs of R with and without a
generation: without the key, one would fail R's live transfer), unsigned and signed with a key
of its own. Every message is dropped and counted by type on the prefill, the request's answer is
reference-identical on both legs, and the pair serves the next request.

That the same frames work without the key (the prefill registers the attacker and adds it to
room R's destinations, so it would write R's KV into the attacker's memory) is shown on
upstream's real control loops without servers: test/unit/test_control_mac.py, ``no-key``
variants; without patch 0030 (ablation row ``control-mac-unit``) the keyed variants fail too.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from pdsafe_testkit.attacker import Attacker
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import direct_pd_generate, generate

pytestmark = pytest.mark.server

MAX_NEW = 24
PREFIX = "sglang:pdsafe_"
KINDS = ("announce", "registration", "transfer_info", "abort")


def _dropped(pd, kind: str) -> float:
    return pd.prefill.metric(f"{PREFIX}unauthenticated_{kind}_dropped_total")


def test_a_keyless_process_cannot_join_a_live_transfer(pd, oracle, model_path):
    rng = random.Random(f"control-mac-{pd.backend}")
    attacker = Attacker(pd.backend, f"127.0.0.1:{pd.prefill.bootstrap_port}")
    before = {k: _dropped(pd, k) for k in KINDS}
    ids = random_prompt(rng, 120, model_path)
    room = rng.randrange(1 << 62)
    stop = threading.Event()
    rounds = [0]

    def attack() -> None:
        while not stop.is_set():
            frames = attacker.frames(room, rng.randrange(1, 1 << 63))
            attacker.send(frames + attacker.signed_with_own_key(frames, "not-the-cluster-key"))
            rounds[0] += 1
            time.sleep(0.05)

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        time.sleep(0.2)  # the attack is under way before the request arrives
        p, d = direct_pd_generate(pd, ids, MAX_NEW, room=room)
    finally:
        stop.set()
        t.join(timeout=10)
    oracle.assert_identical(d, ids, MAX_NEW, what=f"{pd.backend} decode leg of room {room} "
                                                   f"under attack ({rounds[0]} rounds)")
    assert p.ok, f"{pd.backend}: prefill leg {p.status}: {p.error_message}"
    deadline = time.monotonic() + 10
    while True:  # the counters are exported about once a second
        got = {k: _dropped(pd, k) - before[k] for k in KINDS}
        if all(v >= 2 * rounds[0] for v in got.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(v >= 2 * rounds[0] for v in got.values()), (
        f"{pd.backend}: {rounds[0]} attack rounds (each kind unsigned and wrongly signed), "
        f"dropped: {got}")

    q = random_prompt(rng, 60, model_path)
    oracle.assert_identical(generate(pd.router.url, q, MAX_NEW), q, MAX_NEW,
                            what=f"{pd.backend} router request after the attack")
