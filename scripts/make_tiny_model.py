#!/usr/bin/env python3
"""Build, check and fingerprint the tiny "period copy" Llama used by the KV-leak tests.

The checkpoint (default ``test/assets/tiny-copy-llama/``) is a 1-layer HF-transformers
``LlamaForCausalLM`` (float32, RoPE, GQA) plus a WordLevel tokenizer, trained from scratch on CPU
by this script with fixed seeds.

Task ("period copy", ``PERIOD`` = 16): after ANY prompt ``x[0..L-1]`` of word tokens with
``PERIOD < L <= 1024``, greedy decoding emits ``x[L-P], x[L-P+1], ...`` i.e. every new token
equals the token ``P`` positions back (``y[n] = y[n-P]`` over prompt + output). The model
implements this with purely positional attention: the query at position ``n`` attends to key
position ``n - P + 1`` and copies that token through the value/output path.

Invariants the tests rely on:

* One decoder layer, so the K/V stored for position ``j`` depend only on (token ``x[j]``, ``j``).
  A request whose KV pages hold another request's KV therefore "sees" the foreign tokens and
  copies them into its output (``foreign_kv_demo`` proves it with HF transformers).
* Prompts must have >= P tokens (the eval uses > P). Below P the token P back does not exist and
  the output is arbitrary with near-zero logit margins, i.e. not stable under batching noise.
* The output is a pure function of the prompt tokens; special tokens (``<pad>`` ``<s>`` ``</s>``
  ``<unk>``, ids 0-3) are never targets, so the model essentially never emits ``</s>`` (eos=2).
* ``rope_theta`` is 10000 (the Llama default), so a reader that ignores ``rope_parameters`` and
  falls back to the default still computes the same model.
* ``config.json`` carries ``pdsafe_copy_period`` (= ``PERIOD``); tests derive the expected
  continuation from it.
* ``--check`` fails (exit 1) unless greedy accuracy >= ``ACCURACY_BAR`` on every eval length, the
  smallest top-1/top-2 logit margin is >= ``MARGIN_BAR``, the tokenizer round-trips, the
  foreign-KV demo shows the foreign tokens, and ``MANIFEST.sha256`` (if present) matches.

Training (``train``): AdamW (warmup + cosine LR, grad clip 1), 800 steps in three length stages
(32-96, 128-384, 512-1088 tokens, so every position a 1000-token prompt + 32 new tokens reaches
is trained). A training row is a random prefix of log-uniform length followed by its period
continuation, with loss only on the continuation; half of each batch draws its tokens from a
small random sub-vocabulary (repeated distractors punish soft attention). The embedding init
sets dim 0 to the constant ``EMBED_CARRIER`` for every token: Llama has no biases, and this
"carrier" feature lets q/k learn content-independent positional attention (without it the
learned attention stayed soft and content dependent, and short prompts failed). Cost: ~140 s of
single-thread CPU time on the 2-core dev box (wall time grows only if other processes share it).

Determinism: data, init and eval draw from seeded ``torch.Generator`` s, training runs with
``torch.set_num_threads(2)`` (``--threads``) and ``torch.use_deterministic_algorithms(True)``.
On the same machine and torch build a re-run produces bit-identical weights (verified: two full
runs gave the same ``model.safetensors`` sha256; 1 and 2 threads also gave identical weights).
Another CPU/BLAS may change low-order bits, but the training margin is wide enough (min logit
margin ~9.5 vs bar 3) that the accuracy bar is met every time.

Usage::

    python scripts/make_tiny_model.py                  # train, save, eval, write MANIFEST.sha256
    python scripts/make_tiny_model.py --check          # load committed checkpoint, eval (< 60 s)
    python scripts/make_tiny_model.py --sha            # (re)write MANIFEST.sha256 only
    python scripts/make_tiny_model.py --threads 1      # same weights; faster on a busy machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _define_torchvision_op_schemas() -> None:
    """Let a CUDA-only ``torchvision`` wheel import beside CPU torch (see docs/cpu.md).

    transformers imports torchvision when it is installed; its ``_meta_registrations`` need the
    ``torchvision::nms``/``qnms`` schemas, which a CPU torch lacks. Defining them is harmless and
    skipped when they already exist (e.g. a real CPU torchvision or a project-wide shim).
    """
    lib: torch.library.Library | None = None
    for op in ("nms", "qnms"):
        try:
            torch._C._get_schema(f"torchvision::{op}", "")
        except RuntimeError:
            if lib is None:
                lib = torch.library.Library("torchvision", "FRAGMENT")
                _KEEP_ALIVE.append(lib)
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_KEEP_ALIVE: list[torch.library.Library] = []
_define_torchvision_op_schemas()

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DynamicCache  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "test" / "assets" / "tiny-copy-llama"
MANIFEST_NAME = "MANIFEST.sha256"

# --- task -------------------------------------------------------------------------------------
PERIOD = 16
"""Copy period P: every generated token equals the token P positions back."""

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
N_SPECIAL = len(SPECIAL_TOKENS)
N_WORDS = 508
VOCAB_SIZE = N_SPECIAL + N_WORDS  # 512; word token "w{i}" has id N_SPECIAL + i

# --- architecture -----------------------------------------------------------------------------
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 1
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
ROPE_THETA = 10000.0
MAX_POSITIONS = 4096
RMS_NORM_EPS = 1e-6

# --- training ---------------------------------------------------------------------------------
TRAIN_SEED = 1234
NUM_THREADS = 2
PEAK_LR = 3e-3
FINAL_LR_FRACTION = 0.05
WARMUP_STEPS = 50
GRAD_CLIP = 1.0
SUBVOCAB_ROWS = 0.5
"""Fraction of each training batch drawn from a small random sub-vocabulary (see period_batch)."""
EMBED_CARRIER = 0.25
"""Init value of embedding dim 0 for every token: a constant "carrier" feature from which q/k
can learn purely positional (content-independent) attention."""


@dataclass(frozen=True)
class Stage:
    """One stage: ``steps`` batches of ``batch`` sequences, lengths in [min_len, max_len]."""

    min_len: int
    max_len: int
    batch: int
    steps: int


CURRICULUM: tuple[Stage, ...] = (
    Stage(min_len=32, max_len=96, batch=32, steps=300),
    Stage(min_len=128, max_len=384, batch=16, steps=200),
    Stage(min_len=512, max_len=1088, batch=8, steps=300),
)
"""Lengths go past 1024 + 32 so every position an eval prompt (<= 1000) + 32 new tokens reaches
was trained on."""

# --- eval -------------------------------------------------------------------------------------
EVAL_SEED = 987654321
EVAL_LENGTHS: tuple[int, ...] = (20, 64, 200, 400, 700, 1000)
EVAL_PROMPTS_PER_LENGTH = 64
EVAL_NEW_TOKENS = 32
ACCURACY_BAR = 0.999
MARGIN_BAR = 3.0
"""Smallest accepted top-1 minus top-2 logit gap over all eval steps (float32 noise is ~1e-5)."""

DEMO_PROMPT_LEN = 400
DEMO_SPLICE_LEN = 40
DEMO_NEW_TOKENS = 40

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %} {% endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{% endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
)
"""Message contents joined by single spaces; ``add_generation_prompt`` adds nothing."""


# ============================================================================ model + tokenizer


def build_config() -> LlamaConfig:
    """Return the fixed LlamaConfig (extra key ``pdsafe_copy_period`` = ``PERIOD``)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        pdsafe_copy_period=PERIOD,
    )
    config._attn_implementation = "sdpa"
    return config


def word(i: int) -> str:
    """Return the text of word token ``i`` (0 <= i < N_WORDS); its id is ``N_SPECIAL + i``."""
    return f"w{i}"


def build_tokenizer() -> Tokenizer:
    """WordLevel tokenizer: ids 0-3 are the special tokens, then ``w0``..``w{N_WORDS-1}``.

    No post-processor, so encoding never adds BOS/EOS; decoding joins tokens with spaces.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): N_SPECIAL + i for i in range(N_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def tokenizer_config() -> dict[str, Any]:
    """Return the ``tokenizer_config.json`` content (PreTrainedTokenizerFast, no BOS added)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": MAX_POSITIONS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> GenerationConfig:
    """Greedy by default (``do_sample`` false, no temperature/top-p/top-k defaults)."""
    return GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )


def save_checkpoint(model: LlamaForCausalLM, out: Path) -> None:
    """Write config, safetensors weights, generation config and tokenizer files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    model.generation_config = generation_config()
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")


def load_checkpoint(out: Path) -> LlamaForCausalLM:
    """Load the checkpoint in float32 with SDPA attention, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model


# ============================================================================ data


def random_words(gen: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    """Uniform random word-token ids (never special tokens)."""
    return torch.randint(N_SPECIAL, VOCAB_SIZE, tuple(shape), generator=gen)


def period_batch(
    gen: torch.Generator, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch`` training sequences of ``length`` tokens and their labels.

    Each row has a random (non-periodic) prefix of length ``L0`` log-uniform in [P, length-1]
    (so short prompts / small positions are trained in every stage), followed by the period
    continuation ``x[n] = x[n-P]`` for ``n >= L0``. Labels are the input ids at continuation
    positions and -100 (ignored) on the prefix, which matches the eval distribution "random
    prompt, then greedy continuation" and rules out non-positional shortcuts (offsets 2P, 3P, ...
    point into the random prefix).
    """
    x = random_words(gen, (batch, length))
    if SUBVOCAB_ROWS > 0:
        # Low-entropy rows: tokens from a random subset of K words, K log-uniform in [2, N_WORDS].
        # Repeated wrong tokens near the target offset punish soft (unsharp) attention.
        k = (2 * (N_WORDS / 2) ** torch.rand((batch, 1), generator=gen, dtype=torch.float64)).long()
        k[int(batch * SUBVOCAB_ROWS) :] = N_WORDS
        perm = torch.rand((batch, N_WORDS), generator=gen).argsort(1)
        pick = (torch.rand((batch, length), generator=gen, dtype=torch.float64) * k).long()
        x = N_SPECIAL + torch.gather(perm, 1, pick.clamp(max=N_WORDS - 1))
    u = torch.rand((batch, 1), generator=gen, dtype=torch.float64)
    l0 = (PERIOD * (length / PERIOD) ** u).long().clamp(PERIOD, length - 1)
    pos = torch.arange(length).unsqueeze(0)
    cont = pos >= l0
    src = torch.where(cont, l0 - PERIOD + (pos - l0) % PERIOD, pos)
    x = torch.gather(x, 1, src)
    labels = torch.where(cont, x, torch.full_like(x, -100))
    return x, labels


def period_continuation(prompt: Sequence[int], n_new: int) -> list[int]:
    """Return the ``n_new`` tokens following ``prompt`` under ``y[n] = y[n-P]``."""
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(seq[-PERIOD])
    return seq[len(prompt) :]


# ============================================================================ training


def lr_at(step: int, total: int) -> float:
    """Linear warmup for WARMUP_STEPS, then cosine decay to FINAL_LR_FRACTION * PEAK_LR."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    t = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return PEAK_LR * (
        FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * t))
    )


def train() -> LlamaForCausalLM:
    """Train the model from scratch following CURRICULUM; deterministic given the seeds."""
    torch.manual_seed(TRAIN_SEED)
    model = LlamaForCausalLM(build_config()).float()
    if EMBED_CARRIER:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = EMBED_CARRIER
    model.train()
    gen = torch.Generator().manual_seed(TRAIN_SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.98), weight_decay=0.0)
    total = sum(s.steps for s in CURRICULUM)
    step = 0
    t0 = time.perf_counter()
    for si, stage in enumerate(CURRICULUM):
        for i in range(stage.steps):
            length = int(torch.randint(stage.min_len, stage.max_len + 1, (1,), generator=gen))
            x, labels = period_batch(gen, stage.batch, length)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB_SIZE), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            step += 1
            if i % 100 == 0 or i == stage.steps - 1:
                with torch.no_grad():
                    mask = labels[:, 1:] != -100
                    acc = (logits[:, :-1].argmax(-1) == labels[:, 1:])[mask].float().mean().item()
                print(
                    f"stage {si} step {i:4d}/{stage.steps} len {length:4d} "
                    f"loss {loss.item():.5f} acc {acc:.4f} lr {lr_at(step - 1, total):.2e} "
                    f"t {time.perf_counter() - t0:6.1f}s",
                    flush=True,
                )
    model.eval()
    return model


# ============================================================================ eval


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM,
    prompts: torch.Tensor,
    n_new: int,
    splice: tuple[DynamicCache, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy-decode ``n_new`` tokens for equal-length ``prompts`` [B, L] with a KV cache.

    Returns (tokens [B, n_new], margins [B, n_new]) where a margin is top-1 minus top-2 logit.
    If ``splice=(donor_cache, k)`` is given, after the prefill (which yields the first token) the
    last ``k`` cached positions of every layer are overwritten with ``donor_cache``'s.
    """
    out = model(input_ids=prompts, use_cache=True)
    cache = out.past_key_values
    if splice is not None:
        donor, k = splice
        for layer, donor_layer in zip(cache.layers, donor.layers, strict=True):
            layer.keys[:, :, -k:] = donor_layer.keys[:, :, -k:]
            layer.values[:, :, -k:] = donor_layer.values[:, :, -k:]
    logits = out.logits[:, -1]
    tokens: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    for i in range(n_new):
        top2 = logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        if i + 1 < n_new:
            out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(margins, 1)


@dataclass
class EvalRow:
    """Greedy-continuation result for one prompt length."""

    length: int
    tokens: int
    correct: int
    exact_seqs: int
    seqs: int
    min_margin: float
    median_margin: float

    @property
    def accuracy(self) -> float:
        """Per-token accuracy."""
        return self.correct / self.tokens


def evaluate(model: LlamaForCausalLM) -> list[EvalRow]:
    """Greedy-decode EVAL_NEW_TOKENS after held-out random prompts of each EVAL_LENGTHS length."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    rows: list[EvalRow] = []
    for length in EVAL_LENGTHS:
        prompts = random_words(gen, (EVAL_PROMPTS_PER_LENGTH, length))
        got, margins = greedy(model, prompts, EVAL_NEW_TOKENS)
        want = torch.tensor([period_continuation(p, EVAL_NEW_TOKENS) for p in prompts.tolist()])
        ok = got == want
        m = margins.flatten().tolist()
        rows.append(
            EvalRow(
                length=length,
                tokens=ok.numel(),
                correct=int(ok.sum()),
                exact_seqs=int(ok.all(1).sum()),
                seqs=EVAL_PROMPTS_PER_LENGTH,
                min_margin=min(m),
                median_margin=statistics.median(m),
            )
        )
    return rows


def print_eval(rows: Sequence[EvalRow]) -> None:
    """Print the eval table."""
    print(
        f"{'len':>5} {'tokens':>7} {'acc':>8} {'exact seqs':>11} "
        f"{'min margin':>11} {'median margin':>14}"
    )
    for r in rows:
        print(
            f"{r.length:5d} {r.tokens:7d} {r.accuracy:8.4%} {r.exact_seqs:5d}/{r.seqs:<5d} "
            f"{r.min_margin:11.2f} {r.median_margin:14.2f}"
        )


def foreign_kv_demo(model: LlamaForCausalLM) -> bool:
    """Show that a request reading another request's KV copies the *foreign* tokens.

    Prompts A and B (DEMO_PROMPT_LEN random words each) are prefilled with ``use_cache=True``.
    A's first new token comes from its own prefill (A[-P]); then the last DEMO_SPLICE_LEN cached
    positions of A are overwritten with B's, and greedy decoding continues. With one layer the
    cache then encodes the token sequence A[:-k] + B[-k:], so the output must be exactly the
    period continuation of (A[:-k] + B[-k:] + [A[-P]]) -- 15 of every 16 tokens are B's. Returns
    True iff the spliced output equals that prediction and differs from A's clean continuation.
    """
    gen = torch.Generator().manual_seed(EVAL_SEED + 1)
    a = random_words(gen, (1, DEMO_PROMPT_LEN))
    b = random_words(gen, (1, DEMO_PROMPT_LEN))
    k = DEMO_SPLICE_LEN
    clean, _ = greedy(model, a, DEMO_NEW_TOKENS)
    b_out = model(input_ids=b, use_cache=True)
    spliced, margins = greedy(model, a, DEMO_NEW_TOKENS, splice=(b_out.past_key_values, k))
    a_list, b_list = a[0].tolist(), b[0].tolist()
    first = a_list[-PERIOD]
    # What the spliced cache encodes, with each token's origin ("A" own, "B" foreign).
    seen = a_list[:-k] + b_list[-k:] + [first]
    origin = ["A"] * (DEMO_PROMPT_LEN - k) + ["B"] * k + ["A"]
    for _ in range(DEMO_NEW_TOKENS - 1):
        seen.append(seen[-PERIOD])
        origin.append(origin[-PERIOD])
    predicted = seen[DEMO_PROMPT_LEN:]
    marks = "".join(origin[DEMO_PROMPT_LEN:])
    got = spliced[0].tolist()

    def words(ids: Sequence[int]) -> str:
        return " ".join(word(i - N_SPECIAL) for i in ids)

    print(
        f"foreign-KV demo: prompts A, B of {DEMO_PROMPT_LEN} tokens; "
        f"B's KV spliced into A's last {k} positions"
    )
    print(f"  A clean output : {words(clean[0].tolist())}")
    print(f"  A expected     : {words(period_continuation(a_list, DEMO_NEW_TOKENS))}")
    print(f"  B expected     : {words(period_continuation(b_list, DEMO_NEW_TOKENS))}")
    print(f"  A spliced out  : {words(got)}")
    print(f"  token origin   : {marks}  (B = copied from B's spliced KV)")
    n_diff = sum(g != c for g, c in zip(got, clean[0].tolist(), strict=True))
    ok = got == predicted and got != clean[0].tolist()
    print(
        f"  spliced output == prediction from A[:-{k}]+B[-{k}:]: {got == predicted}; "
        f"{marks.count('B')}/{len(got)} tokens from B, {n_diff} differ from A's clean output; "
        f"min margin {margins.min().item():.2f}"
    )
    return ok


def tokenizer_roundtrip(out: Path) -> bool:
    """Check AutoTokenizer maps "w1 w2 w3" to ids 5 6 7 (no BOS) and back, and the chat template."""
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("w1 w2 w3")["input_ids"]
    text = tok.decode(ids)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "w1 w2"}, {"role": "user", "content": "w3"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ok = (
        ids == [N_SPECIAL + 1, N_SPECIAL + 2, N_SPECIAL + 3]
        and text == "w1 w2 w3"
        and chat == "w1 w2 w3"
    )
    print(f"tokenizer round-trip: ids {ids} -> {text!r}; chat template -> {chat!r}; ok={ok}")
    return ok


def check(out: Path) -> bool:
    """Load ``out`` and run every check; print the report. True iff all bars are met."""
    t0 = time.perf_counter()
    ok = verify_manifest(out)
    ok = tokenizer_roundtrip(out) and ok
    model = load_checkpoint(out)
    period = getattr(model.config, "pdsafe_copy_period", None)
    if period != PERIOD:
        print(f"config pdsafe_copy_period={period!r}, expected {PERIOD}")
        ok = False
    rows = evaluate(model)
    print_eval(rows)
    total = sum(r.tokens for r in rows)
    correct = sum(r.correct for r in rows)
    all_m = [r.min_margin for r in rows]
    acc_ok = all(r.accuracy >= ACCURACY_BAR for r in rows)
    margin_ok = min(all_m) >= MARGIN_BAR
    print(
        f"overall accuracy {correct}/{total} = {correct / total:.4%} "
        f"(bar {ACCURACY_BAR:.1%} per length: {'ok' if acc_ok else 'FAIL'}); "
        f"min margin {min(all_m):.2f} (bar {MARGIN_BAR}: "
        f"{'ok' if margin_ok else 'FAIL'})"
    )
    demo_ok = foreign_kv_demo(model)
    passed = ok and acc_ok and margin_ok and demo_ok
    print(f"check {'passed' if passed else 'FAILED'} in {time.perf_counter() - t0:.1f}s")
    return passed


# ============================================================================ manifest


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_lines(out: Path) -> list[str]:
    """``sha256sum``-style lines for every file in ``out`` except the manifest, sorted by name."""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    return [f"{file_sha256(p)}  {p.name}" for p in files]


def write_manifest(out: Path) -> None:
    """Write ``MANIFEST.sha256`` (checkable with ``sha256sum -c`` inside ``out``) and list sizes."""
    lines = manifest_lines(out)
    (out / MANIFEST_NAME).write_text("\n".join(lines) + "\n", encoding="utf-8")
    total = 0
    for p in sorted(out.iterdir()):
        total += p.stat().st_size
        print(f"  {p.stat().st_size:9d}  {p.name}")
    print(f"  {total:9d}  total ({total / 2**20:.2f} MiB)")
    for line in lines:
        print(f"  {line}")


def verify_manifest(out: Path) -> bool:
    """True if ``out/MANIFEST.sha256`` is absent or matches the files; prints mismatches."""
    path = out / MANIFEST_NAME
    if not path.exists():
        print(f"no {MANIFEST_NAME} in {out} (not verified)")
        return True
    want = path.read_text(encoding="utf-8").splitlines()
    got = manifest_lines(out)
    if want != got:
        print(f"{MANIFEST_NAME} mismatch:\n  want {want}\n  got  {got}")
        return False
    print(f"{MANIFEST_NAME}: {len(got)} files match")
    return True


# ============================================================================ main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 = all bars met)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint dir (default {DEFAULT_OUT})"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="only load the checkpoint and run the eval"
    )
    mode.add_argument("--sha", action="store_true", help="only (re)write MANIFEST.sha256")
    parser.add_argument(
        "--threads",
        type=int,
        default=NUM_THREADS,
        help=f"torch CPU threads (default {NUM_THREADS}; results are bit-identical for 1 and 2)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.sha:
        write_manifest(out)
        return 0
    if args.check:
        return 0 if check(out) else 1

    t0 = time.perf_counter()
    model = train()
    train_s = time.perf_counter() - t0
    print(f"training took {train_s:.1f}s ({sum(p.numel() for p in model.parameters())} parameters)")
    save_checkpoint(model, out)
    write_manifest(out)
    ok = check(out)
    print(f"total {time.perf_counter() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
