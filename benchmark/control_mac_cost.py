"""What signing and checking a PD control message costs (``sglang.pdsafe.control_mac``), next to
what upstream already spends on the same message, measured side by side in one run.

For each message, built with upstream 0.5.23's own builders on a stand-in manager (so the frames
are exactly a real leg's): the time to seal it and to check it (``verified``'s work: split,
MAC, compare), against upstream's own parse of it (``TransferInfo.from_zmq`` for metadata,
``parse_kv_status_message`` for a KV status), and against the time the KV it stands for takes
to move at ``--link-gbps`` (default 25 GB/s, one 200 Gb/s NIC) for a model of ``--kv-bytes-per-
token`` (default 131072: 32 layers, 8 KV heads x 128 x bf16, K and V). Ratios only; nothing
here is asserted by a test.

Usage: ``.venv/bin/python -m benchmark.control_mac_cost [--out DIR] [--quick]``; writes
``control_mac_cost.json`` and prints a table.

What it does not measure: the ZMQ send and receive themselves (unchanged, plus one frame of 44
bytes), or contention with the scheduler thread (the checks run on the backend's control
thread).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Pages per metadata message: a short request at page 1, a 2k prompt, the incident's 1M
#: tokens at page size 64 and at page size 1.
PAGES = (16, 2048, 16384, 1 << 20)


def _time(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def measure(pages: tuple[int, ...], reps: int, kv_bytes_per_token: int,
            link_gbps: float) -> list[dict[str, Any]]:
    from pdsafe_testkit.attacker import _manager
    from sglang.pdsafe import control_mac
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    (key,) = control_mac._mac_keys(("benchmark-cluster-key",))
    m = _manager("mooncake", "decode-bench", 5555)
    rows = []
    status = [b"123456789", b"4", b"0", b"", b"PDSAFE_GEN1:1234567890123"]
    signed = control_mac.seal(key, control_mac.P2D, status)
    rows.append({
        "message": "KV status (Success)",
        "bytes": sum(len(f) for f in status),
        "seal_us": _time(lambda: control_mac.seal(key, control_mac.P2D, status), reps) * 1e6,
        "check_us": _time(lambda: control_mac.valid([key], control_mac.P2D,
                                                     *control_mac.split(signed)), reps) * 1e6,
        "upstream_parse_us": _time(lambda: m.parse_kv_status_message(status), reps) * 1e6,
        "tokens": None,
    })
    for n in pages:
        msg = list(m.build_receiver_metadata_message(
            bootstrap_room=123456789, required_dst_info_num=1,
            kv_indices=np.arange(n, dtype=np.int32), aux_index=0, state_indices=None,
            decode_prefix_len=None, is_dummy=False)) + [b"PDSAFE_GEN1:1234567890123"]
        sealed = control_mac.seal(key, control_mac.D2P, msg)
        r = max(3, reps // max(1, n // 4096))
        rows.append({
            "message": f"metadata, {n} pages",
            "bytes": sum(len(f) for f in msg),
            "seal_us": _time(lambda m=msg: control_mac.seal(key, control_mac.D2P, m), r) * 1e6,
            "check_us": _time(lambda s=sealed: control_mac.valid([key], control_mac.D2P,
                                                                 *control_mac.split(s)), r) * 1e6,
            "upstream_parse_us": _time(lambda m=msg: TransferInfo.from_zmq(m), r) * 1e6,
            "tokens": n,
        })
    for row in rows:
        row["mac_over_parse"] = (row["seal_us"] + row["check_us"]) / row["upstream_parse_us"]
        if row["tokens"]:
            # The least KV these pages stand for (page size 1); at page size P, P times more.
            kv_s = row["tokens"] * kv_bytes_per_token / (link_gbps * 1e9)
            row["mac_over_kv_transfer_page1"] = (row["seal_us"] + row["check_us"]) / 1e6 / kv_s
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/bench-control-mac"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller messages")
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072)
    ap.add_argument("--link-gbps", type=float, default=25.0, help="GB/s of the KV transfer")
    a = ap.parse_args(argv)
    rows = measure(PAGES[:2] if a.quick else PAGES, 20 if a.quick else 200,
                   a.kv_bytes_per_token, a.link_gbps)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "control_mac_cost.json").write_text(json.dumps(rows, indent=1))
    print("| message | bytes | seal us | check us | upstream parse us | (seal+check)/parse | "
          "(seal+check)/KV transfer at page 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kv = r.get("mac_over_kv_transfer_page1")
        print(f"| {r['message']} | {r['bytes']} | {r['seal_us']:.1f} | {r['check_us']:.1f} | "
              f"{r['upstream_parse_us']:.1f} | {r['mac_over_parse']:.2f} | "
              f"{'-' if kv is None else f'{kv:.5f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
