"""The support matrix: which protection covers a PD transfer, per transfer backend and KV layout.

``docs/kv-support.md`` publishes it (rendered by ``scripts/support-matrix.py``; the test
``test/unit/test_support_matrix.py`` fails when the page and this module disagree). Every cell is
derived here from the tables the protections themselves act on, never kept by hand:

* the backends are upstream's ``TransferBackend`` values (:data:`BACKENDS`; the test fails when
  upstream adds one nobody classified);
* *generation*: :data:`sglang.pdsafe.transfer_generation.UNWIRED_BACKENDS` (a server on such a
  backend refuses to start, :func:`transfer_generation.check_backend`); the test checks each
  backend's real KV manager class (``pdsafe_transfer_generation_wired``, patch 0025) against it;
* the fake backend: :func:`sglang.pdsafe.startup.check_fake_transfer` refuses it;
* *digest*: :data:`sglang.pdsafe.kv_layouts.CLASSES` (the digest's own dispatch table), with the
  pool classes each backend's hardware builds (:data:`POOL_FAMILIES`: Ascend builds only its NPU
  classes);
* *coverage* and *quarantine* run in the common PD layer (the queues and
  ``CommonKVManager``) for every backend whose server starts.

Layout of the two tables (what :func:`render` writes):

* backend x protection (:func:`backend_cells`): one row per backend, one column per protection
  in :data:`PROTECTIONS`; a cell is ``covered``, ``refused`` (the server does not start; the
  reason is the startup message's gist and its waiver) or ``n/a``;
* layout x backend, for the digest (:func:`layout_cells`): one row per layout the digest reads
  (:data:`kv_layouts.LAYOUTS`) plus one for the refused classes, one column per backend.

What it proves and what it does not: a cell says which check the code *runs*; that each check
holds is shown by its own tests (named in the reason column). It does not say that a backend
or layout was exercised here: MORI and Ascend cannot run on this CPU machine (their cells
come from the same code paths, shown without servers in the unit tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.pdsafe import kv_integrity, kv_layouts, startup, transfer_generation

#: Upstream 0.5.23's ``disaggregation.utils.TransferBackend`` values, in its order.
BACKENDS: tuple[str, ...] = ("mooncake", "mori", "nixl", "ascend", "fake")
#: The protections a PD transfer gets (README's protection list names each).
PROTECTIONS: tuple[str, ...] = ("coverage", "generation", "digest", "quarantine")
#: The KV manager class of each backend (``module:Class`` under ``sglang.srt.disaggregation``).
MANAGERS: dict[str, str] = {
    "mooncake": "mooncake.conn:MooncakeKVManager",
    "mori": "mori.conn:MoriKVManager",
    "nixl": "nixl.conn:NixlKVManager",
    "ascend": "ascend.conn:AscendKVManager",
    "fake": "fake.conn:FakeKVManager",
}
#: Which device pool classes a backend's servers build (a prefix of ``kv_layouts.CLASSES``'
#: keys): Ascend runs on NPUs, whose pools are the ``hardware_backend.npu`` classes; every
#: other backend runs upstream's GPU/CPU pools (every class outside ``hardware_backend``).
POOL_FAMILIES: dict[str, str] = {"ascend": "hardware_backend.npu."}

COVERED, REFUSED, NA = "covered", "refused", "n/a"


@dataclass(frozen=True)
class Cell:
    state: str  # COVERED, REFUSED or NA
    why: str = ""

    def text(self) -> str:
        return self.state + (f": {self.why}" if self.why else "")


def _startup_refusal(backend: str) -> Cell | None:
    """The refusal every protection of a server on ``backend`` shares (None: it starts)."""
    if backend == "fake":
        return Cell(REFUSED, "the server refuses to start (no KV moves; a decode would serve "
                             f"pages nobody wrote); {startup.ENV_WAIVE_FAKE}=1 serves zeroed "
                             "pages with every check off")
    if backend in transfer_generation.UNWIRED_BACKENDS:
        return Cell(REFUSED, "the server refuses to start: its messages carry no transfer "
                             "generation, so rows of an earlier reservation of a room would "
                             f"verify; {transfer_generation.ENV_WAIVE_UNWIRED}=1 serves it "
                             "with rows bound to generation 0")
    return None


def generation_wired(backend: str) -> bool:
    """The backend's messages carry the transfer generation (what its KV manager's
    ``pdsafe_transfer_generation_wired`` must say; the fake backend sends no messages)."""
    return backend != "fake" and backend not in transfer_generation.UNWIRED_BACKENDS


def pool_classes(backend: str) -> list[str]:
    """The ``kv_layouts.CLASSES`` keys of the pools ``backend``'s servers can build."""
    prefix = POOL_FAMILIES.get(backend)
    if prefix is not None:
        return sorted(k for k in kv_layouts.CLASSES if k.startswith(prefix))
    return sorted(k for k in kv_layouts.CLASSES if not k.startswith("hardware_backend."))


def _digest_cell(backend: str) -> Cell:
    classes = pool_classes(backend)
    if not any(kv_layouts.CLASSES[k] in kv_layouts.LAYOUTS for k in classes):
        reasons = sorted({kv_layouts.CLASSES[k].removeprefix("refused: ") for k in classes})
        return Cell(REFUSED, "every pool class it builds is refused: the server does not "
                             f"start while the digest is on ({kv_integrity.ENV_ENABLE}=0 on "
                             "both legs serves it without); " + "; ".join(reasons))
    return Cell(COVERED)


def backend_cells(backend: str) -> dict[str, Cell]:
    """Protection -> cell for a PD server on ``backend``."""
    refusal = _startup_refusal(backend)
    if refusal is not None:
        return dict.fromkeys(PROTECTIONS, refusal)
    return {"coverage": Cell(COVERED), "generation": Cell(COVERED),
            "digest": _digest_cell(backend), "quarantine": Cell(COVERED)}


#: What a ``covered`` cell means, per protection (printed under the table).
MEANS: dict[str, str] = {
    "coverage": "the coverage row (token digest, page count, the transfer's generation and "
                "its aux rows) travels in the metadata buffers every backend transfers and is "
                "checked at the decode's commit (`sglang.pdsafe.coverage`)",
    "generation": "every control message of a transfer carries the reservation's generation, "
                  "signed under the cluster key when one is set; a stale or forged one is "
                  "dropped (`sglang.pdsafe.transfer_generation`, `sglang.pdsafe.control_mac`)",
    "digest": "the decode checks the KV it received against the prefill's sealed digest "
              "before its first decode step, for the layouts of the second table; any other "
              "pool refuses the start (`sglang.pdsafe.kv_digest`)",
    "quarantine": "decode pages of a failed or aborted transfer are held until the writer's "
                  "ACK, its new incarnation or an operator releases them "
                  "(`sglang.pdsafe.quarantine`)",
}


def layout_cells(layout: str) -> dict[str, Cell]:
    """Backend -> digest cell for ``layout`` (a :data:`kv_layouts.LAYOUTS` value)."""
    out = {}
    for backend in BACKENDS:
        if _startup_refusal(backend) is not None:
            out[backend] = Cell(REFUSED, "the server does not start (above)")
        elif any(kv_layouts.CLASSES[k] == layout for k in pool_classes(backend)):
            out[backend] = Cell(COVERED)
        else:
            out[backend] = Cell(NA, "no pool class of this layout on its hardware")
    return out


def _classes_of(layout: str) -> str:
    keys = sorted(k for k, v in kv_layouts.CLASSES.items() if v == layout)
    return ", ".join(f"`{k.split(':')[1]}`" for k in keys)


def render() -> str:
    """The generated part of ``docs/kv-support.md`` (between its markers)."""
    lines = ["| backend | " + " | ".join(PROTECTIONS) + " |",
             "|---|" + "---|" * len(PROTECTIONS)]
    notes = []
    for b in BACKENDS:
        refusal = _startup_refusal(b)
        if refusal is not None:  # every cell the same refusal: once, as a note
            notes.append(f"* **{b}**: {refusal.why}.")
            texts = ["refused (the server does not start, below)"] * len(PROTECTIONS)
        else:
            cells = backend_cells(b)
            texts = [cells[p].text() for p in PROTECTIONS]
        lines.append(f"| {b} | " + " | ".join(texts) + " |")
    lines += ["", *notes, *(f"* *{p}* covered: {MEANS[p]}." for p in PROTECTIONS), "",
              "The digest by layout (coverage, generation and quarantine do not depend on "
              "the layout):", "",
              "| layout | pool classes | " + " | ".join(BACKENDS) + " |",
              "|---|---|" + "---|" * len(BACKENDS)]
    for layout in sorted(kv_layouts.LAYOUTS):
        cells = layout_cells(layout)
        lines.append(f"| {layout} | {_classes_of(layout)} | "
                     + " | ".join(cells[b].state for b in BACKENDS) + " |")
    refused = {b: sum(1 for k in pool_classes(b) if kv_layouts.CLASSES[k] not in
                      kv_layouts.LAYOUTS) for b in BACKENDS}
    lines.append("| any other | the refused classes of the class table below | "
                 + " | ".join(f"refused ({refused[b]} classes)" for b in BACKENDS) + " |")
    return "\n".join(lines) + "\n"
