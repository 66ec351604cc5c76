"""What page generations cost upstream's free (issue 9, item 1), on a 100k-page pool.

  PYTHONPATH=<materialized tree>/python python -m benchmark.page_generation_cost
      [--pages 100000] [--reps 15] [--calls 200] [--upstream-src DIR] [--json OUT.json]

Needs the patched upstream (a tree materialized with the page-generation patch, or an install
of the fork): upstream's allocators call the table from their free funnel.

Builds three real allocators of the same size, side by side in one process, on the CPU:

* ``upstream``: the allocator class of the pristine 0.5.23 wheel, loaded from
  ``--upstream-src`` (the ``sglang/`` directory of the unpacked pinned wheel; default
  ``build/upstream-src/sglang``, made by ``python -m zipfile -e <the wheel in
  ~/.cache/sglang-pdsafe/wheels> build/upstream-src``; the column is left out when absent):
  upstream's own ``free`` (and clear), unpatched;
* ``off``: the patched class without a table (a non-PD server, or the off switch): upstream
  plus the patch's one ``is not None`` check;
* ``on``: the patched class with a ``sglang.pdsafe.page_generation`` table attached by
  ``install()`` (a PD server).

All free lists are PD's (``need_sort=True``). For every cell (allocator class x pages per
free call) each repetition allocates ``--calls`` requests' worth of pages on each (untimed),
then times ``--calls`` upstream ``free()`` calls of one request each; the order of the three
rotates per repetition so a shared machine's load drift hits them alike. Reported: the median
over ``--reps`` of the per-call time, the extra nanoseconds per free of ``on`` over
``upstream`` and the on/upstream ratio (on/off when the pristine source is absent).

Also the per-transfer checks (only with the table): ``snapshot`` of a request's pages plus
``changed`` at commit, for the same request sizes.

The pool's KV buffers are tiny (1 layer, 1 head, dim 1): the free path never touches KV
memory, only the free list and the table, so the numbers are those of a 100k-page pool of any
model. One core (``torch.set_num_threads(1)``), as upstream's scheduler thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
PD = SimpleNamespace(disaggregation_mode="decode", disaggregation_decode_host_receive_threshold=1)


@dataclass
class Row:
    allocator: str
    page_size: int
    pages_per_free: int
    upstream_ns: float | None  # the pristine wheel's class (None: source not given)
    off_ns: float
    on_ns: float
    extra_ns: float
    ratio: float
    check_us: float  # snapshot at reservation + changed() at commit, one request


def _pool(tokens: int, ps: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=tokens, page_size=ps, dtype=torch.float16, head_num=1,
                            head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)


def _pristine(src: Path | None) -> dict[int, type] | None:
    """The pristine wheel's allocator classes (page 1, paged), loaded from its source under
    private module names; their imports resolve to the running tree (whose base class differs
    only by the patch's class attribute)."""
    import importlib.util

    if src is None or not (src / "srt/mem_cache/allocator/paged.py").is_file():
        return None
    out: dict[int, type] = {}
    for key, (mod, cls) in {1: ("token", "TokenToKVPoolAllocator"),
                            16: ("paged", "PagedTokenToKVPoolAllocator")}.items():
        spec = importlib.util.spec_from_file_location(
            f"_pristine_{mod}", src / f"srt/mem_cache/allocator/{mod}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out[key] = getattr(module, cls)
        assert "pdsafe" not in (src / f"srt/mem_cache/allocator/{mod}.py").read_text(), \
            f"{src} is not the pristine upstream source"
    return out


def _allocator(ps: int, pages: int, classes: dict[int, type] | None = None) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if classes is not None:
        TokenToKVPoolAllocator = classes[1]  # noqa: N806 - the pristine class
        PagedTokenToKVPoolAllocator = classes[16]  # noqa: N806
    tokens = pages * ps
    if ps == 1:
        return TokenToKVPoolAllocator(tokens, torch.float16, "cpu", _pool(tokens, 1),
                                      need_sort=True)
    return PagedTokenToKVPoolAllocator(tokens, ps, torch.float16, "cpu", _pool(tokens, ps),
                                       need_sort=True)


def _time_frees(a: Any, chunks: list[torch.Tensor]) -> float:
    t0 = time.perf_counter_ns()
    for c in chunks:
        a.free(c)
    return (time.perf_counter_ns() - t0) / len(chunks)


def _chunks(a: Any, calls: int, pages_per_free: int) -> list[torch.Tensor]:
    n = pages_per_free * a.page_size
    out = []
    for _ in range(calls):
        x = a.alloc(n)
        assert x is not None, "pool too small for --calls x pages per free"
        out.append(x)
    return out


def measure(ps: int, pages: int, pages_per_free: int, reps: int, calls: int,
            pristine: dict[int, type] | None) -> Row:
    from sglang.pdsafe import page_generation

    cells = {"off": _allocator(ps, pages), "on": _allocator(ps, pages)}
    if pristine is not None:
        cells["upstream"] = _allocator(ps, pages, pristine)
    on = cells["on"]
    assert page_generation.install(on, SimpleNamespace(), PD)
    assert cells["off"].pdsafe_page_generations is None
    names = list(cells)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 1):  # the first repetition warms them up and is dropped
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            chunks = _chunks(cells[name], calls, pages_per_free)
            times[name].append(_time_frees(cells[name], chunks))
    med = {n: statistics.median(t[1:]) for n, t in times.items()}
    base = med.get("upstream", med["off"])
    checks = []
    for _ in range(reps):
        x = on.alloc(pages_per_free * ps)
        page_ids = torch.unique(x // ps)
        t0 = time.perf_counter_ns()
        snap = page_generation.snapshot(on, page_ids)
        moved = page_generation.changed(on, page_ids, snap)
        checks.append((time.perf_counter_ns() - t0) / 1000)
        assert moved == []
        on.free(x)
    return Row(type(on).__name__, ps, pages_per_free, med.get("upstream"), med["off"],
               med["on"], med["on"] - base, med["on"] / base, statistics.median(checks))


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--upstream-src", type=Path,
                    default=REPO / "build" / "upstream-src" / "sglang")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pristine = _pristine(args.upstream_src)
    rows = []
    for ps, sizes in ((1, (1, 16, 256)), (16, (1, 16, 256)), (64, (1, 4, 64))):
        for n in sizes:
            if args.calls * n > args.pages:
                continue
            rows.append(measure(ps, args.pages, n, args.reps, args.calls, pristine))
    head = (f"page generations vs upstream free, {args.pages} pages per pool, median of "
            f"{args.reps} reps x {args.calls} free() calls, 1 thread, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    base = "upstream" if pristine is not None else "off"
    print(head + f"; baseline: {base}"
          + ("" if pristine else f" (pristine source not found at {args.upstream_src})"))
    print(f"{'allocator':<28}{'page':>5}{'pages/free':>11}{'upstream ns':>12}{'off ns':>8}"
          f"{'on ns':>8}{'extra ns':>9}{'ratio':>7}{'check us':>9}")
    for r in rows:
        up = "-" if r.upstream_ns is None else f"{r.upstream_ns:.0f}"
        print(f"{r.allocator:<28}{r.page_size:>5}{r.pages_per_free:>11}{up:>12}"
              f"{r.off_ns:>8.0f}{r.on_ns:>8.0f}{r.extra_ns:>9.0f}{r.ratio:>7.2f}"
              f"{r.check_us:>9.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": head, "rows": [asdict(r) for r in rows]},
                                        indent=2))
    return rows


if __name__ == "__main__":
    main()
