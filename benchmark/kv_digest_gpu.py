"""The KV digest's Triton leaf hashing on a GPU: bit-identity with xxhash, then GB/s vs HBM.

Prepared for a device session (docs/kv-digest.md, "The GPU path"). Needs torch with CUDA (or
ROCm), triton and xxhash, and NOT sglang: it imports only ``sglang.pdsafe.kv_digest_triton``
(standalone: torch, numpy, triton) from this checkout's ``python/``::

    PYTHONPATH=python python -m benchmark.kv_digest_gpu --out build/bench-kv-digest-gpu
    TRITON_INTERPRET=1 PYTHONPATH=python python -m benchmark.kv_digest_gpu --tiny   # no GPU

Steps, all timed against a budget of about 2 minutes on an H200:

1. **Bit-identity**: leaves of random data (every short-path length class, long leaves around
   XXH3's stripe and block boundaries, 64 KiB leaves, unaligned offsets, all-zero and all-0xFF
   data, several MB in all) hashed on the device with each ``blocks`` setting, compared with
   ``xxhash.xxh3_128_digest`` on the host. Any difference exits with status 1 before timing.
2. **Kernel bandwidth**: a 4 GiB random buffer cut into 64 KiB leaves (the digest's full
   leaf), hashed by the kernels alone (``run_plan``, CUDA events, the leaf plan on the device
   already), for every (``blocks``, ``num_warps``) candidate: GB/s of bytes hashed and its
   fraction of the H200's 4.8 TB/s HBM bandwidth (the kernel reads each byte once).
3. **As the digest runs it**: 64 MiB launches (``kv_digest.DEVICE_BATCH_BYTES``) through the
   public ``xxh3_128_leaves`` (plan, launch, digests back to the host as bytes), and the same
   with a page gather first (``index_select`` of 2 KiB rows on shuffled 16-slot pages into
   the launch buffer, as ``kv_digest``'s device path does), for the best kernel candidate;
   and the same token rows read out of AITER's ``vectorized_5d`` page blocks (the covered
   layout whose rows are strided within a page).

Output: a markdown table on stdout and, with ``--out DIR``, ``kv_digest_gpu.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.pdsafe import kv_digest_triton as kdt

H200_HBM_BYTES_PER_S = 4.8e12
LEAF = 64 * 1024
BATCH = 64 * 1024 * 1024  # kv_digest.DEVICE_BATCH_BYTES (not imported: that module needs no
#                           sglang either, but this script stays on the kernel module alone)


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else \
        f"{n >> 10} KiB"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], Any], dev: torch.device, reps: int) -> list[float]:
    """Seconds per call, ``reps`` times, after one warm-up call (compiles the kernel)."""
    fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def check_identity(dev: torch.device, tiny: bool) -> list[str]:
    """Step 1; returns the failures (empty: bit-identical)."""
    rng = np.random.default_rng(2026)
    lengths = [*range(0, 17), 31, 32, 33, 64, 65, 127, 128, 129, 200, 239, 240, 241, 255, 256,
               257, 1023, 1024, 1025, 4095, 4096, 4097, LEAF - 1, LEAF, LEAF + 1]
    reps = 1 if tiny else 24
    if tiny:  # the interpreter hashes about 100 KB/s: one 64 KiB leaf per kind only
        lengths = [n for n in lengths if n <= 4097] + [LEAF]
    cases: list[tuple[str, np.ndarray, list[int], list[int]]] = []
    for kind in ("random", "zero", "ff"):
        n = (sum(lengths) + 8 * len(lengths)) * reps + 64
        data = (rng.integers(0, 256, n, dtype=np.uint8) if kind == "random"
                else np.full(n, 0 if kind == "zero" else 0xFF, dtype=np.uint8))
        offs, lens, pos = [], [], 0
        for r in range(reps if kind == "random" else 1):
            for ln in lengths:
                offs.append(pos + (r % 8))  # every alignment
                lens.append(ln)
                pos += ln + 8
        cases.append((kind, data, offs, lens))
    bad: list[str] = []
    for kind, data, offs, lens in cases:
        want = [xxhash.xxh3_128_digest(data[o:o + n].tobytes()) for o, n in zip(offs, lens,
                                                                                strict=True)]
        buf = torch.from_numpy(data).to(dev)
        for blocks in ((1, 4) if tiny else kdt.BLOCK_CHOICES):
            got = kdt.xxh3_128_leaves(buf, offs, lens, blocks=blocks)
            bad += [f"{kind} blocks={blocks} off={o} len={n}"
                    for o, n, g, w in zip(offs, lens, got, want, strict=True) if g != w]
    return bad


def bench(dev: torch.device, tiny: bool, reps: int) -> list[dict[str, Any]]:
    """Steps 2 and 3; one row per measurement."""
    total = (128 * 1024) if tiny else (4 << 30)
    buf = torch.empty(total, dtype=torch.uint8, device=dev)
    if tiny:
        buf.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    else:
        buf.view(torch.int64).random_()
    rows: list[dict[str, Any]] = []

    def row(what: str, cfg: str, nbytes: int, secs: list[float]) -> dict[str, Any]:
        med = statistics.median(secs)
        r = {"what": what, "config": cfg, "bytes": nbytes, "median_s": med,
             "min_s": min(secs), "max_s": max(secs), "gb_s": nbytes / med / 1e9,
             "hbm_fraction": nbytes / med / H200_HBM_BYTES_PER_S}
        rows.append(r)
        print(f"  {what:<38} {cfg:<20} {r['gb_s']:9.3f} GB/s  {100 * r['hbm_fraction']:5.1f}% "
              f"of 4.8 TB/s", flush=True)
        return r

    starts = np.arange(0, total, LEAF, dtype=np.int64)
    plan = kdt.plan_leaves(buf, starts, np.minimum(LEAF, total - starts))
    cands = [(1, 4), (4, 4)] if tiny else [(b, w) for b in kdt.BLOCK_CHOICES for w in (2, 4, 8)]
    best: tuple[float, int, int] = (0.0, kdt.DEFAULT_BLOCKS, 4)
    for blocks, warps in cands:
        r = row(f"kernel, {_size(total)} in 64 KiB leaves", f"blocks={blocks} warps={warps}",
                total, _time(lambda b=blocks, w=warps: kdt.run_plan(buf, plan, blocks=b,
                                                                    num_warps=w), dev, reps))
        best = max(best, (r["gb_s"], blocks, warps))
    _, blocks, warps = best
    cfg = f"blocks={blocks} warps={warps}"

    batch = min(BATCH, total // 2)  # the rest of the buffer is the gather's pool
    part = buf[:batch]
    offs = np.arange(0, batch, LEAF, dtype=np.int64)
    lens = np.minimum(LEAF, batch - offs)
    row(f"xxh3_128_leaves, {_size(batch)} launches", cfg, batch,
        _time(lambda: kdt.xxh3_128_leaves(part, offs, lens, blocks=blocks, num_warps=warps),
              dev, reps))

    # Gather + hash: 2 KiB rows (a 32 x 8 x 128 bf16 layer's K row) on shuffled 16-slot pages
    # of a pool (the rest of the 4 GiB buffer), gathered into the launch buffer, then hashed.
    row_bytes, page = 2048, 16
    pool = buf[batch:].narrow(0, 0, (total - batch) // row_bytes * row_bytes).view(-1, row_bytes)
    n_rows = batch // row_bytes
    pages = torch.randperm(pool.shape[0] // page, device=dev)[: n_rows // page]
    idx = (pages[:, None] * page + torch.arange(page, device=dev)[None, :]).reshape(-1)
    out = torch.empty((n_rows, row_bytes), dtype=torch.uint8, device=dev)
    t = max(1, LEAF // row_bytes)
    g_offs = np.arange(0, n_rows, t, dtype=np.int64) * row_bytes
    g_lens = np.minimum(t * row_bytes, n_rows * row_bytes - g_offs)

    def gather_hash() -> list[bytes]:
        torch.index_select(pool, 0, idx, out=out)
        return kdt.xxh3_128_leaves(out.view(-1), g_offs, g_lens, blocks=blocks, num_warps=warps)

    row("gather (page 16) + xxh3_128_leaves", cfg, n_rows * row_bytes,
        _time(gather_hash, dev, reps))

    # The same 2 KiB token rows out of AITER's vectorized_5d K blocks (pages, H=8, D/X=16,
    # page=16, X=8; bf16): each token's (H, D) row is strided through its page block, read
    # with the index arithmetic kv_digest._vectorized_5d_components uses.
    heads, x = 8, 8
    dx = row_bytes // 2 // heads // x
    blocks5 = pool.reshape(-1).view(torch.bfloat16)
    n_pages = blocks5.numel() // (heads * dx * page * x)
    blocks5 = blocks5[: n_pages * heads * dx * page * x].view(n_pages, heads, dx, page, x)
    out5 = out

    def gather_5d_hash() -> list[bytes]:
        rows5 = blocks5[idx // page, :, :, idx % page, :]  # [n, H, D/X, X]
        out5.copy_(rows5.reshape(n_rows, -1).view(torch.uint8))
        return kdt.xxh3_128_leaves(out5.view(-1), g_offs, g_lens, blocks=blocks,
                                   num_warps=warps)

    row("vectorized_5d gather + xxh3_128_leaves", cfg, n_rows * row_bytes,
        _time(gather_5d_hash, dev, reps))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="a few hundred KiB (Triton's interpreter on a CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10; 2 tiny)")
    ap.add_argument("--out", type=Path, default=None, help="write kv_digest_gpu.md/.json here")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.tiny else 10)
    if kdt.interpreting():
        dev = torch.device("cpu")
        if not args.tiny:
            print("Triton's interpreter is on: only --tiny makes sense", file=sys.stderr)
            return 2
    elif kdt.available("cuda"):
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA/HIP device with Triton (set TRITON_INTERPRET=1 and --tiny to run on a CPU)",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    import triton

    head = (f"device: {name}; torch {torch.__version__}, triton {triton.__version__}, "
            f"xxhash {xxhash.VERSION}")
    print(head, flush=True)
    t0 = time.perf_counter()
    bad = check_identity(dev, args.tiny)
    print(f"bit-identity vs xxhash: {'OK' if not bad else f'{len(bad)} FAILED'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if bad:
        print("\n".join(bad[:20]), file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    rows = bench(dev, args.tiny, reps)
    print(f"timing: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        lines = [head, "", "| measurement | config | GB/s (median) | min-max GB/s | "
                 "of H200 HBM 4.8 TB/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['what']} | {r['config']} | {r['gb_s']:.3g} | "
                  f"{r['bytes'] / r['max_s'] / 1e9:.3g}-{r['bytes'] / r['min_s'] / 1e9:.3g} | "
                  f"{100 * r['hbm_fraction']:.1f}% |" for r in rows]
        (args.out / "kv_digest_gpu.md").write_text("\n".join(lines) + "\n")
        (args.out / "kv_digest_gpu.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__,
             "identity": "ok", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
