"""Deployment mode's preflight: can this reference judge this deployment token for token?

The benchmark calls an answer a leak when it differs from the co-located reference's greedy
answer. That is only sound when both compute the same numbers: same model and weights, same
dtype, KV dtype and quantization, and a deterministic forward pass. On GPUs greedy decoding is
deterministic across batch compositions only with ``--enable-deterministic-inference`` (batch-
invariant kernels): without it a prompt batched differently on the PD pair than on the
reference can pick another token at a near-tie, which the benchmark would report as a leak. So
before any scenario runs, ``check`` reads every server's ``/server_info`` and says, per finding:

* ``error``: the reference cannot judge this deployment (another model, dtype, KV dtype or
  quantization; a server in the wrong role; instances of one leg that disagree on the backend
  or the page size). The run stops (exit 2) unless ``--ignore-preflight``.
* ``warning``: determinism is not guaranteed (a GPU server without
  ``--enable-deterministic-inference``: expect false leaks; an error with
  ``--require-determinism``), or a setting that changes the numbers slightly differs (attention
  backend, tensor parallelism).
* ``note``: what the preflight cannot see (a CPU server's thread count).

Then ``repeat_probe`` sends one greedy prompt to the reference alone and again among other
requests (another batch): different answers prove the reference is not deterministic here.

Invariant: the preflight only reads ``/server_info`` and sends ordinary ``/generate`` requests
to the reference; it never touches the PD servers' state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

#: Settings that change the numbers a forward pass computes: must be equal everywhere.
MUST_MATCH = ("dtype", "kv_cache_dtype", "quantization")
#: Settings whose difference changes reduction order (tiny numeric differences, near-ties).
SHOULD_MATCH = ("attention_backend", "tp_size")


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "note"
    what: str


def _mode(info: Mapping[str, Any]) -> str:
    mode = info.get("disaggregation_mode") or "null"
    return str(getattr(mode, "value", mode)).lower()


def _model(info: Mapping[str, Any]) -> str:
    return str(info.get("served_model_name") or info.get("model_path") or "?")


def _gpu(info: Mapping[str, Any]) -> bool:
    return str(info.get("device") or "cpu").lower() not in ("cpu", "")


def check(infos: Mapping[str, Mapping[str, Any]], *,
          require_determinism: bool = False) -> list[Finding]:
    """Findings for the servers ``infos`` (role -> ``/server_info``; roles ``reference``,
    ``prefill``, ``prefill-2``, ..., ``decode``, ...)."""
    out: list[Finding] = []
    out += _roles(infos)
    out += _same_model(infos)
    out += _same_numbers(infos)
    out += _legs_agree(infos)
    out += _determinism(infos, require_determinism)
    return out


def _roles(infos: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    out = []
    for role, info in infos.items():
        want = "null" if role == "reference" else role.split("-")[0]
        if _mode(info) != want:
            out.append(Finding("error", f"{role} runs disaggregation_mode={_mode(info)!r}, "
                                        f"expected {want!r} (the reference must be co-located)"))
    return out


def _same_model(infos: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    models = {role: _model(i) for role, i in infos.items()}
    if len(set(models.values())) > 1:
        return [Finding("error", f"the servers serve different models: {models}; the reference "
                                 "must serve the deployment's model and weights")]
    return []


def _same_numbers(infos: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    out = []
    for key, level in [(k, "error") for k in MUST_MATCH] + [(k, "warning") for k in SHOULD_MATCH]:
        vals = {role: i.get(key) for role, i in infos.items()}
        if len({str(v) for v in vals.values()}) > 1:
            out.append(Finding(level, f"{key} differs between the servers: {vals}"
                               + ("; the reference computes other numbers than the deployment"
                                  if level == "error" else
                                  "; reductions run in another order, so near-ties may break "
                                  "differently (false leaks possible)")))
    return out


def _legs_agree(infos: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    out = []
    for leg in ("prefill", "decode"):
        roles = [r for r in infos if r.split("-")[0] == leg]
        for key in ("disaggregation_transfer_backend", "page_size", "context_length"):
            vals = {r: infos[r].get(key) for r in roles}
            if len({str(v) for v in vals.values()}) > 1:
                out.append(Finding("error", f"the {leg} instances disagree on {key}: {vals}"))
    return out


def _determinism(infos: Mapping[str, Mapping[str, Any]], require: bool) -> list[Finding]:
    gpu_off = [r for r, i in infos.items()
               if _gpu(i) and not i.get("enable_deterministic_inference")]
    out = []
    if gpu_off:
        out.append(Finding(
            "error" if require else "warning",
            f"determinism not guaranteed: {', '.join(gpu_off)} run(s) on "
            f"{infos[gpu_off[0]].get('device')} without --enable-deterministic-inference. "
            "Greedy answers can then depend on how a request was batched, and the benchmark "
            "reports every such difference as a leak (false leaks). Start the reference and "
            "every PD server with --enable-deterministic-inference (and the same attention "
            "backend) for a token-exact comparison."))
    cpu = [r for r, i in infos.items() if not _gpu(i)]
    if cpu:
        out.append(Finding(
            "note", f"{', '.join(cpu)} run(s) on the CPU: greedy answers are reproducible only "
                    "with the same dtype and thread count on every server (the CPU harness "
                    "sets OMP_NUM_THREADS=1); the thread count is not visible here, the repeat "
                    "probe checks the reference"))
    return out


def repeat_probe(send: Callable[[list[int], int], list[int] | None], *, vocab: int,
                 seed: int = 0, length: int = 48, max_new: int = 16,
                 concurrent: Callable[[list[tuple[list[int], int]]], list[list[int] | None]]
                 ) -> list[Finding]:
    """The same greedy prompt alone, then among three other prompts sent at once: the
    reference must answer it identically both times. ``send(prompt, max_new)`` -> output ids
    (None: no answer); ``concurrent(jobs)`` sends jobs at once, answers in order."""
    rng = random.Random(seed)
    ids = list(range(10, max(11, min(vocab, 30000))))
    prompt = [rng.choice(ids) for _ in range(length)]
    alone = send(prompt, max_new)
    others = [([rng.choice(ids) for _ in range(rng.randint(16, 4 * length))], max_new)
              for _ in range(3)]
    batched = concurrent([(prompt, max_new), *others])[0]
    if alone is None or batched is None:
        return [Finding("error", "the reference did not answer the repeat probe")]
    if alone != batched:
        return [Finding("error", "the reference answered one greedy prompt differently alone "
                                 f"and in a batch ({alone[:8]} vs {batched[:8]}): it is not "
                                 "deterministic, so every comparison with it is unsound")]
    return [Finding("note", "repeat probe: the reference answered a greedy prompt identically "
                            "alone and in a batch")]


def to_json(findings: list[Finding]) -> list[dict[str, str]]:
    return [asdict(f) for f in findings]


def blocking(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]
