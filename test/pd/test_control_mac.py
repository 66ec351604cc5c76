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


def _under_attack(pd, oracle, ids: list[int], room: int, attack_round) -> int:
    """Run ``attack_round()`` every 50 ms from before a request of ``room`` reaches the pair
    until both legs answered; the decode leg must be reference-identical and the prefill leg
    served. Returns the number of rounds sent."""
    stop = threading.Event()
    rounds = [0]

    def attack() -> None:
        while not stop.is_set():
            attack_round()
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
    return rounds[0]


def _counted(read, want: dict[str, float], what: str) -> None:
    """``read()`` (counter deltas by kind) reaches ``want`` within 10 s (the counters are
    exported about once a second)."""
    deadline = time.monotonic() + 10
    while True:
        got = read()
        if all(got[k] >= want[k] for k in want) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(got[k] >= want[k] for k in want), f"{what}: dropped {got}, expected {want}"


def test_a_keyless_process_cannot_join_a_live_transfer(pd, oracle, model_path):
    rng = random.Random(f"control-mac-{pd.backend}")
    attacker = Attacker(pd.backend, f"127.0.0.1:{pd.prefill.bootstrap_port}")
    before = {k: _dropped(pd, k) for k in KINDS}
    ids = random_prompt(rng, 120, model_path)
    room = rng.randrange(1 << 62)

    def attack_round() -> None:
        frames = attacker.frames(room, rng.randrange(1, 1 << 63))
        attacker.send(frames + attacker.signed_with_own_key(frames, "not-the-cluster-key"))

    rounds = _under_attack(pd, oracle, ids, room, attack_round)
    _counted(lambda: {k: _dropped(pd, k) - before[k] for k in KINDS},
             dict.fromkeys(KINDS, 2 * rounds),
             f"{pd.backend}: {rounds} attack rounds (each kind unsigned and wrongly signed)")

    q = random_prompt(rng, 60, model_path)
    oracle.assert_identical(generate(pd.router.url, q, MAX_NEW), q, MAX_NEW,
                            what=f"{pd.backend} router request after the attack")


DECODE_KINDS = {"mooncake": ("kv_status", "aux_data", "abort_ack"),
                "nixl": ("kv_status", "chunk_ready", "abort_ack")}


def _decode_dropped(pd) -> dict[str, float]:
    kinds = DECODE_KINDS[pd.backend]
    out = {k: pd.decode.metric(f"{PREFIX}unauthenticated_{k}_dropped_total") for k in kinds}
    out["stale"] = sum(pd.decode.metric(f"{PREFIX}stale_{k}_dropped_total")
                       for k in kinds if k != "abort_ack")
    return out


def test_a_keyless_process_cannot_touch_a_decodes_live_room(pd, oracle, model_path):
    """The decode side of the attack: the attacker finds the decode's control port by scanning
    the decode's listening ports for a ZMQ greeting (the port is published nowhere) and, while
    a request of room R is in flight, sends it what a prefill would: Success and Failed
    statuses, aux data (Mooncake) or CHUNK_READY (NIXL), ABORT_ACKs, each with a guessed
    generation and without one, unsigned and signed with a key of its own. Without the key, a
    Success would conclude R's transfer over
    pages nobody wrote, aux data would seed R's first token, a Failed would fail R, an ACK
    would release pages a writer may still reach (upstream's real decode control loop takes
    each: test/unit/test_control_mac.py and test/unit/test_transfer_generation.py, their no-key
    variants). Keyed: R's answer is
    reference-identical, the pair serves the next request, and the messages are counted as
    dropped by type (those with a generation or a MAC as unauthenticated, the generation-less
    ones as stale). The generation-less Failed failed R until 2026-12-07 when it landed while
    R's receiver was open and its metadata not yet out (upstream takes it as the request's
    terminal state): ``transfer_generation.drops_stale_message`` now drops it there, since no
    prefill can address a notice to a room this decode told none about
    (test/unit/test_transfer_generation.py)."""
    from pdsafe_testkit.attacker import DecodeAttacker, zmq_listening_ports

    rng = random.Random(f"control-mac-decode-{pd.backend}")
    attacker = DecodeAttacker(pd.backend, zmq_listening_ports(pd.decode.process.proc.pid))
    before = _decode_dropped(pd)
    ids = random_prompt(rng, 120, model_path)
    room = rng.randrange(1 << 62)

    def attack_round() -> None:
        by_kind = attacker.frames(room, rng.randrange(1, 1 << 63))
        unsigned = [m for ms in by_kind.values() for m in ms]
        attacker.send(unsigned + attacker.signed_with_own_key(unsigned, "not-the-key"))

    rounds = _under_attack(pd, oracle, ids, room, attack_round)
    # Per round and kind: the copies signed with the attacker's key and the unsigned ones that
    # carry a generation (kv_status: four signed, two unsigned; aux/chunk: two and one); the
    # generation-less Success and aux/chunk notices are stale (two; the generation-less Failed
    # too once R's receiver is open: before, upstream ignores a status of a room nobody holds).
    # The ACKs count only their signed copies for sure: an unsigned one is dropped once R's
    # metadata is out; before, no abort of R exists that it could touch (upstream ignores an
    # ACK no abort waits for).
    want = {k: (6 if k == "kv_status" else 2 if k == "abort_ack" else 3) * rounds
            for k in DECODE_KINDS[pd.backend]}
    want["stale"] = 2 * rounds

    def delta() -> dict[str, float]:
        after = _decode_dropped(pd)
        return {k: after[k] - before[k] for k in after}

    _counted(delta, want, f"{pd.backend}: {rounds} decode-side attack rounds")

    q = random_prompt(rng, 60, model_path)
    oracle.assert_identical(generate(pd.router.url, q, MAX_NEW), q, MAX_NEW,
                            what=f"{pd.backend} next request after the decode-side attack")
