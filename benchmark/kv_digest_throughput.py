"""CPU digest throughput over real KV pool pages (issue 10): which hash, and what it costs.

  python -m benchmark.kv_digest_throughput [--out DIR] [--tokens N] [--page-sizes 16,64]
      [--layers 32 --heads 8 --head-dim 128 --dtype bfloat16] [--reps 5]

Builds a real ``sglang.srt.mem_cache.memory_pool.MHATokenToKVPool`` on the CPU (default 32
layers x 8 KV heads x 128 head_dim, bf16, 8192 token slots), fills it with random bytes, places
one request of ``--tokens`` tokens (a partial last page) on randomly chosen pages, and measures,
side by side in one run, on one core (``torch.set_num_threads(1)``; every library here hashes
on the calling thread), the candidate digests over that request's owned rows of every K and V
buffer:

* ``pre-gathered``: the rows already gathered into one contiguous buffer per component: the
  hash alone (no gather);
* ``gather+hash``: ``index_select`` of the rows into a preallocated buffer, then the hash (the
  gather a transfer does, included);
* ``zero-copy``: the hash fed straight from the pool's memory, one update per run of
  consecutive slots (a page, or more), with no copy; ``google-crc32c`` takes only ``bytes``,
  so it copies every run first.

and ``sglang.pdsafe.kv_digest.digest_request`` itself end to end (leaves, header, root; paths
``auto``, ``stream``, ``gather``) on the pool prepared once (``kv_digest.prepare``, as a server
does), and once with the per-call setup (an unprepared pool), plus on an MLA pool (61 layers x
576 bf16), an MHA pool in AITER's vectorized_5d layout and a DSA pool (61 layers, index_kpool
1; ``--no-layouts`` skips the last two).

GB/s = owned bytes digested (tokens x row bytes x components) / median seconds over ``--reps``
repetitions, after one warm-up call per cell; the repetitions are interleaved across all cells
of a pool (rep 1 of every cell, then rep 2, ...), so a drift of a shared machine's load hits
every candidate alike. Writes DIR/kv_digest_throughput.json and .md (default DIR:
build/bench-kv-digest) and prints the table. Missing optional packages (``xxhash``,
``google-crc32c``, ``crc32c``) are reported as not installed, not failed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path("build/bench-kv-digest")


@dataclass
class Candidate:
    """A digest: ``one_shot(buffer)``; ``stream(buffers)`` hashes a sequence incrementally."""

    name: str
    package: str
    bits: int
    one_shot: Callable[[Any], Any]
    stream: Callable[[Sequence[Any]], Any]
    note: str = ""


def _opt(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _running(update: Callable[[Any, int], int]) -> Callable[[Sequence[Any]], int]:
    def run(bufs: Sequence[Any]) -> int:
        v = 0
        for b in bufs:
            v = update(b, v)
        return v
    return run


def _hasher(factory: Callable[[], Any]) -> Callable[[Sequence[Any]], bytes]:
    def run(bufs: Sequence[Any]) -> bytes:
        h = factory()
        for b in bufs:
            h.update(b)
        return h.digest()
    return run


def candidates() -> tuple[list[Candidate], list[str]]:
    """The candidates whose packages are importable, and the names of those that are not."""
    out: list[Candidate] = []
    missing: list[str] = []
    xx = _opt("xxhash")
    if xx is not None:
        out.append(Candidate("XXH3-64", f"xxhash {xx.VERSION}", 64, xx.xxh3_64_digest,
                             _hasher(xx.xxh3_64)))
        out.append(Candidate("XXH3-128", f"xxhash {xx.VERSION}", 128, xx.xxh3_128_digest,
                             _hasher(xx.xxh3_128)))
    else:
        missing += ["XXH3-64 (xxhash)", "XXH3-128 (xxhash)"]
    gc = _opt("google_crc32c")
    if gc is not None:
        impl = getattr(gc, "implementation", "?")
        out.append(Candidate(
            "CRC32C (google-crc32c)", f"google-crc32c {_version('google-crc32c')} ({impl})", 32,
            lambda b: gc.value(bytes(b)), _running(lambda b, v: gc.extend(v, bytes(b))),
            "takes only bytes: every buffer is copied first"))
    else:
        missing.append("CRC32C (google-crc32c)")
    cc = _opt("crc32c")
    if cc is not None:
        hw = "hardware" if getattr(cc, "hardware_based", False) else "software"
        out.append(Candidate("CRC32C (crc32c)", f"crc32c {_version('crc32c')} ({hw})", 32,
                             cc.crc32c, _running(lambda b, v: cc.crc32c(b, v))))
    else:
        missing.append("CRC32C (crc32c)")
    out.append(Candidate("CRC32 (zlib)", f"zlib {zlib.ZLIB_RUNTIME_VERSION}", 32, zlib.crc32,
                         _running(lambda b, v: zlib.crc32(b, v))))
    out.append(Candidate("Adler-32 (zlib)", f"zlib {zlib.ZLIB_RUNTIME_VERSION}", 32,
                         zlib.adler32, _running(lambda b, v: zlib.adler32(b, v)),
                         "upstream's algorithm"))
    out.append(Candidate("BLAKE2b-128 (hashlib)", "hashlib", 128,
                         lambda b: hashlib.blake2b(b, digest_size=16).digest(),
                         _hasher(lambda: hashlib.blake2b(digest_size=16))))
    return out, missing


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001 - only for the report
        return "?"


def _interleaved(cells: Sequence[tuple[str, str, Callable[[], Any]]],
                 reps: int) -> list[list[float]]:
    """Seconds per repetition of every cell, the repetitions interleaved across the cells.

    One warm-up call per cell, then rep 1 of every cell, rep 2 of every cell, ...: a slow drift
    of a shared machine (other jobs) hits every candidate alike instead of the last ones.
    """
    for _, _, fn in cells:
        fn()
    times: list[list[float]] = [[] for _ in cells]
    for _ in range(reps):
        for i, (_, _, fn) in enumerate(cells):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


@dataclass
class Row:
    layout: str
    page_size: int
    digest: str
    mode: str
    gb_s: float
    gb_s_min: float
    gb_s_max: float
    bytes: int
    note: str = ""
    bits: int = 0


@dataclass
class Report:
    command: str
    machine: dict[str, Any]
    request: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    not_installed: list[str] = field(default_factory=list)


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        info["simd"] = [x for x in ("sse4_2", "avx2", "avx512f", "pclmulqdq") if f" {x}" in flags]
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _fill_random(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in list(getattr(pool, "k_buffer", [])) + list(getattr(pool, "v_buffer", [])) + list(
            getattr(pool, "kv_buffer", [])):
        u8 = buf.view(torch.uint8).reshape(-1)
        u8.copy_(torch.randint(0, 256, (u8.numel(),), dtype=torch.uint8, generator=g))


def _request_row(slots: int, page_size: int, tokens: int, seed: int) -> torch.Tensor:
    """A req_to_token row: the request's positions on random whole pages (slot 0 page skipped)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = -(-tokens // page_size)
    pages = torch.randperm(slots // page_size - 1, generator=g)[:n_pages] + 1
    locs = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return locs[:tokens].to(torch.int32)


def _gb_s(nbytes: int, ts: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) GB/s of the repetitions ``ts`` (seconds)."""
    return nbytes / statistics.median(ts) / 1e9, nbytes / max(ts) / 1e9, nbytes / min(ts) / 1e9


def _run_cells(rep: Report, layout: str, page_size: int, nbytes: int,
               cells: Sequence[tuple[str, str, Callable[[], Any]]],
               meta: dict[str, tuple[str, int]], reps: int) -> None:
    """Measure ``cells`` (name, mode, fn); ``meta``: name -> (note, bits)."""
    for (name, mode, _), ts in zip(cells, _interleaved(cells, reps), strict=True):
        gb = _gb_s(nbytes, ts)
        note, bits = meta.get(name, ("", 128))
        rep.rows.append(Row(layout, page_size, name, mode, *gb, nbytes, note, bits))
        print(f"  page {page_size:3d}  {name:28s} {mode:22s} {gb[0]:7.2f} GB/s", flush=True)


def bench_mha(args: argparse.Namespace, page_size: int, cands: Sequence[Candidate],
              rep: Report) -> None:
    from sglang.pdsafe import kv_digest as kd
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dtype = getattr(torch, args.dtype)
    pool = MHATokenToKVPool(size=args.pool_tokens, page_size=page_size, dtype=dtype,
                            head_num=args.heads, head_dim=args.head_dim, layer_num=args.layers,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    _fill_random(pool, seed=1)
    row = _request_row(args.pool_tokens, page_size, args.tokens, seed=2)
    idx = row.to(torch.int64)
    bufs = [b.view(torch.uint8).reshape(b.shape[0], -1) for b in pool.k_buffer + pool.v_buffer]
    row_bytes = bufs[0].shape[1]
    nbytes = len(bufs) * args.tokens * row_bytes
    layout = (f"MHA {args.layers}L x {args.heads}H x {args.head_dim} {args.dtype}, "
              f"{args.tokens} tokens")
    gathered = [b.index_select(0, idx).numpy() for b in bufs]
    scratch = torch.empty((args.tokens, row_bytes), dtype=torch.uint8)
    scratch_np = scratch.numpy()
    np_bufs = [b.numpy() for b in bufs]
    firsts, lens = kd._runs(idx.numpy())  # consecutive-slot runs (pages, or longer)
    runs = list(zip(firsts.tolist(), lens.tolist(), strict=True))

    cells: list[tuple[str, str, Callable[[], Any]]] = []
    for c in cands:
        def pre(c: Candidate = c) -> None:
            for g in gathered:
                c.one_shot(g)

        def gather_hash(c: Candidate = c) -> None:
            for b in bufs:
                torch.index_select(b, 0, idx, out=scratch)
                c.one_shot(scratch_np)

        def zero_copy(c: Candidate = c) -> None:
            for a in np_bufs:
                c.stream([a[s:s + n] for s, n in runs])

        cells += [(c.name, "pre-gathered", pre), (c.name, "gather+hash", gather_hash),
                  (c.name, "zero-copy", zero_copy)]
    prepared = kd.prepare(pool)
    for path in ("auto", "stream", "gather"):
        cells.append(("kv_digest (XXH3-128 leaves)", f"digest_request {path}",
                      lambda path=path: kd.digest_request(prepared, row, prefix=0,
                                                          length=args.tokens, room=7, path=path)))
    cells.append(("kv_digest (XXH3-128 leaves)", "digest_request auto, unprepared pool",
                  lambda: kd.digest_request(pool, row, prefix=0, length=args.tokens, room=7)))
    _run_cells(rep, layout, page_size, nbytes, cells,
               {c.name: (c.note, c.bits) for c in cands}, args.reps)


def bench_mla(args: argparse.Namespace, page_size: int, rep: Report) -> None:
    from sglang.pdsafe import kv_digest as kd
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    layers = 61
    pool = MLATokenToKVPool(size=args.pool_tokens, page_size=page_size, dtype=torch.bfloat16,
                            kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers,
                            device="cpu", enable_memory_saver=False)
    _fill_random(pool, seed=3)
    row = _request_row(args.pool_tokens, page_size, args.tokens, seed=4)
    nbytes = layers * args.tokens * 576 * 2
    layout = f"MLA {layers}L x 576 bfloat16, {args.tokens} tokens"
    prepared = kd.prepare(pool)
    cells: list[tuple[str, str, Callable[[], Any]]] = [
        ("kv_digest (XXH3-128 leaves)", f"digest_request {path}",
         lambda path=path: kd.digest_request(prepared, row, prefix=0, length=args.tokens,
                                             room=7, path=path))
        for path in ("auto", "gather")]
    _run_cells(rep, layout, page_size, nbytes, cells, {}, args.reps)


def _digest_cells(kd: Any, pool: Any, row: torch.Tensor, tokens: int,
                  **kw: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    prepared = kd.prepare(pool)
    return [("kv_digest (XXH3-128 leaves)", f"digest_request {path}",
             lambda path=path: kd.digest_request(prepared, row, prefix=0, length=tokens,
                                                 room=7, path=path, **kw))
            for path in ("auto", "gather")]


def bench_vectorized_5d(args: argparse.Namespace, page_size: int, rep: Report) -> None:
    """MHA in ROCm AITER's vectorized_5d layout (each token's row strided through its page
    block), same shape as the MHA rows. Upstream builds it only on ROCm: its platform flag is
    set for the constructor alone (the layout needs AITER to be written, not to be laid out)."""
    from pdsafe_testkit.pools import vectorized_5d_pool
    from sglang.pdsafe import kv_digest as kd

    dtype = getattr(torch, args.dtype)
    pool = vectorized_5d_pool(size=args.pool_tokens, page_size=page_size, heads=args.heads,
                              head_dim=args.head_dim, layers=args.layers, dtype=dtype)
    _fill_random(pool, seed=5)
    row = _request_row(args.pool_tokens, page_size, args.tokens, seed=6)
    nbytes = 2 * args.layers * args.tokens * args.heads * args.head_dim * dtype.itemsize
    layout = (f"MHA vectorized_5d {args.layers}L x {args.heads}H x {args.head_dim} "
              f"{args.dtype}, {args.tokens} tokens")
    _run_cells(rep, layout, page_size, nbytes, _digest_cells(kd, pool, row, args.tokens), {},
               args.reps)


def bench_dsa(args: argparse.Namespace, page_size: int, rep: Report) -> None:
    """DSA (MLA latent + rope, plus the indexer's FP8 keys and scales per token; GLM-5's
    family), index_kpool 1: 61 layers of 576 bf16 latent+rope and 128 + 4 index bytes."""
    from sglang.pdsafe import kv_digest as kd
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    layers = 61
    with get_parallel().override(attn_dcp_size=1):
        pool = DSATokenToKVPool(size=args.pool_tokens, page_size=page_size, kv_lora_rank=512,
                                dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=layers,
                                index_head_dim=128, kv_cache_dim=576, device="cpu",
                                enable_memory_saver=False)
    _fill_random(pool, seed=7)
    for buf in pool.index_k_with_scale_buffer:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    row = _request_row(args.pool_tokens, page_size, args.tokens, seed=8)
    comps = kd.components(pool)
    nbytes = sum(c.row_bytes for c in comps) * args.tokens
    layout = f"DSA {layers}L x (576 bfloat16 + 132 B index), {args.tokens} tokens"
    _run_cells(rep, layout, page_size, nbytes, _digest_cells(kd, pool, row, args.tokens), {},
               args.reps)


def markdown(rep: Report) -> str:
    m = rep.machine
    lines = [
        "# KV digest throughput (CPU, one core)", "",
        f"Command: `{rep.command}`  ",
        f"CPU: {m.get('cpu', '?')} ({m.get('cpus')} cores, SIMD: {', '.join(m.get('simd', []))}), "
        f"load average at start {tuple(round(x, 2) for x in m.get('loadavg_start', ()))}, "
        f"at end {tuple(round(x, 2) for x in m.get('loadavg_end', ()))}  ",
        f"Request: {rep.request}  ",
        "GB/s: owned bytes digested / median time (min-max over the repetitions).", "",
    ]
    layouts = sorted({(r.layout, r.page_size) for r in rep.rows}, key=lambda x: (x[0][:3], x[1]))
    for layout, page in layouts:
        rows = [r for r in rep.rows if r.layout == layout and r.page_size == page]
        lines += [f"## {layout}, page size {page}", ""]
        names = [r.digest for r in rows if r.mode == "pre-gathered"]
        if names:
            lines += ["| digest | bits | pre-gathered (no gather) | gather+hash | zero-copy "
                      "| note |", "|---|---|---|---|---|---|"]

        def fmt(r: Row | None) -> str:
            return "-" if r is None else f"{r.gb_s:.2f} ({r.gb_s_min:.2f}-{r.gb_s_max:.2f})"
        for name in names:
            cell = {r.mode: r for r in rows if r.digest == name}
            bits = cell["pre-gathered"].bits
            lines.append(f"| {name} | {bits} | {fmt(cell.get('pre-gathered'))} | "
                         f"{fmt(cell.get('gather+hash'))} | {fmt(cell.get('zero-copy'))} | "
                         f"{cell['pre-gathered'].note} |")
        own = [r for r in rows if r.mode.startswith("digest_request")]
        if own:
            lines += ["", "| `kv_digest.digest_request` path | GB/s (gather included) |",
                      "|---|---|"]
            lines += [f"| {r.mode.removeprefix('digest_request ')} | {fmt(r)} |" for r in own]
        lines.append("")
    if rep.not_installed:
        lines.append(f"Not installed (not measured): {', '.join(rep.not_installed)}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tokens", type=int, default=2043, help="request length (partial last page)")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-mla", action="store_true", help="skip the MLA end-to-end rows")
    ap.add_argument("--no-layouts", action="store_true",
                    help="skip the vectorized_5d and DSA end-to-end rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    cands, missing = candidates()
    cmd = "python -m benchmark.kv_digest_throughput " + " ".join(
        argv if argv is not None else sys.argv[1:])
    rep = Report(command=cmd.strip(), machine=_machine(),
                 request={"tokens": args.tokens, "layers": args.layers, "heads": args.heads,
                          "head_dim": args.head_dim, "dtype": args.dtype,
                          "pool_tokens": args.pool_tokens, "reps": args.reps},
                 not_installed=missing)
    for ps in [int(x) for x in args.page_sizes.split(",") if x]:
        bench_mha(args, ps, cands, rep)
    if not args.no_mla:
        bench_mla(args, 64, rep)
    if not args.no_layouts:
        bench_vectorized_5d(args, 16, rep)
        bench_dsa(args, 64, rep)
    try:
        rep.machine["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_digest_throughput.json").write_text(json.dumps(asdict(rep), indent=2) + "\n")
    md = markdown(rep)
    (args.out / "kv_digest_throughput.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
