"""An MLA model served end to end in PD: the incident's KV layout under the content oracle.

The incident's model family keeps MLA latent KV (``MLATokenToKVPool``: one
``kv_lora_rank + qk_rope`` row per token and layer, no separate K and V). Everything else in
``test/pd`` serves the MHA test model; here a tiny random-weight ``DeepseekV2ForCausalLM``
(``pdsafe_testkit.models.tiny_mla_model``) runs on a co-located reference server and on a PD
pair per backend (real Mooncake TCP, real NIXL/UCX, the real router), on the CPU engine's
``torch_native`` backend with the absorbed MLA path (``sglang.pdsafe.cpu_compat``).

It shows, for that layout:

* the answers depend on the KV: one changed early token changes the reference's greedy answer
  (so an identical answer below is evidence, not an accident of a model that ignores context);
* PD traffic under page reuse (page size 1 on Mooncake, 16 on NIXL: partial last pages of latent
  rows) returns the reference's tokens exactly, and the decode's KV digest verified every
  transfer of the latent pool, refusing none;
* one flipped bit of a transferred latent row, and one page of latent rows changed, are refused
  with HTTP 500 "KV integrity check failed" before the first decode step, counted, and the next
  request is reference-identical;
* the oracle sees foreign latent KV: another request's latent rows written over a request's last
  16 positions after every check (a test-only fault no protection can see) change its answer.

What it does not show: DSA (no DSA model runs here: the indexer needs GPU kernels), a draft
pool (no speculative decoding on the CPU engine), TP > 1. Those layouts are proven on real pool
objects over the real transports in ``test/kv/test_kv_digest_layouts.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdsafe_testkit.backends import BACKENDS, ci_backends
from pdsafe_testkit.kv_checks import (
    answer_with_foreign_kv_after_checks,
    clean_traffic_is_verified,
    corrupted_transfer_is_refused,
)
from pdsafe_testkit.models import tiny_mla_model
from pdsafe_testkit.oracle import Oracle, Verdict, random_prompt, word_token_range
from pdsafe_testkit.servers import (
    PDStack,
    ServerConfig,
    SGLangServer,
    colocated_server,
    direct_pd_generate,
    generate,
    pd_stack,
)

pytestmark = pytest.mark.server

MAX_NEW = 16
POOL = 1024


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mla_model(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture(scope="module")
def mla_reference(mla_model: Path, log_dir: Path) -> Iterator[SGLangServer]:
    with colocated_server(log_dir, ServerConfig(role="colocated", model_path=mla_model,
                                                max_total_tokens=4096)) as server:
        yield server


@pytest.fixture(scope="module")
def mla_oracle(mla_reference: SGLangServer) -> Oracle:
    return Oracle(mla_reference.url)


#: (backend, page size) of the MLA stacks: page size 1 on Mooncake, 16 on NIXL (partial last
#: pages of latent rows), one stack each.
STACKS = list(zip(BACKENDS, (1, 16), strict=True))


@pytest.fixture(scope="module", params=STACKS, ids=[f"{b}-page{p}" for b, p in STACKS])
def mla_pd(request: pytest.FixtureRequest, mla_model: Path, log_dir: Path,
           mla_reference: SGLangServer) -> Iterator[PDStack]:
    """A PD pair + router serving the MLA model (pools of 1024 tokens: pages are reused); the
    decode runs the test-only faults ``foreign_kv:16,kv_corrupt`` (each acts only on rids with
    its prefix)."""
    backend, page = request.param
    with pd_stack(
        backend, log_dir,
        prefill=ServerConfig(role="prefill", model_path=mla_model, max_total_tokens=POOL,
                             context_length=POOL, page_size=page),
        decode=ServerConfig(role="decode", model_path=mla_model, max_total_tokens=POOL,
                            context_length=POOL, page_size=page,
                            env={"SGLANG_PDSAFE_TEST_FAULTS": "foreign_kv:16,kv_corrupt"}),
    ) as stack:
        yield stack


def test_the_mla_models_answer_depends_on_its_kv(mla_reference, mla_model):
    """The reference's greedy answer changes when one early prompt token does: the model reads
    its (latent) KV, so the identical answers below are evidence."""
    rng = random.Random(3)
    prompt = random_prompt(rng, 120, mla_model)
    other = list(prompt)
    lo, hi = word_token_range(mla_model)
    other[4] = lo + (prompt[4] - lo + 1) % (hi - lo)
    a = generate(mla_reference.url, prompt, MAX_NEW)
    b = generate(mla_reference.url, other, MAX_NEW)
    assert a.status == b.status == 200, (a.error_message, b.error_message)
    assert a.output_ids != b.output_ids, "the tiny MLA model ignores its context"


def test_mla_pd_traffic_matches_reference_and_every_transfer_is_verified(mla_pd, mla_oracle,
                                                                          mla_model):
    rng = random.Random(f"mla-{mla_pd.backend}")
    prompts = [random_prompt(rng, rng.randint(17, 200), mla_model) for _ in range(12)]
    assert sum(len(p) + MAX_NEW for p in prompts) > POOL, "no page reuse"
    clean_traffic_is_verified(mla_pd, mla_oracle, prompts, MAX_NEW,
                              what=f"{mla_pd.backend} MLA")


@pytest.mark.parametrize("mode", ["bit", "page"])
def test_a_corrupted_latent_row_is_refused_with_500(mla_pd, mla_oracle, mla_model, mode):
    """One flipped bit of a transferred latent row (``bit``), or every byte of one page of
    latent rows of one layer (``page``), changed at decode commit after the transfer landed:
    refused before the first decode step; the next request is clean."""
    if mla_pd.backend not in ci_backends():
        pytest.skip(f"{mla_pd.backend}: corruption cases run on {ci_backends()} "
                    "(PDSAFE_FULL_BACKENDS=all runs every backend)")
    rng = random.Random(f"mla-corrupt-{mode}")
    prompt = random_prompt(rng, 150, mla_model)
    corrupted_transfer_is_refused(mla_pd, prompt, mode, rng, MAX_NEW,
                                  what=f"{mla_pd.backend} MLA")
    _, clean = direct_pd_generate(mla_pd, prompt, MAX_NEW)
    mla_oracle.assert_identical(clean, prompt, MAX_NEW, what="same prompt, no fault")


def test_the_oracle_sees_foreign_latent_kv(mla_pd, mla_oracle, mla_model):
    """Request A's last 16 latent rows written over request B's after every check (the
    ``pdsafe-fault-postcheck-`` fault: KV that changes after the decode verified it, which no
    protection can see): B's answer is not the reference's, so the oracle would catch a
    leak of foreign MLA KV."""
    rng = random.Random(f"mla-foreign-{mla_pd.backend}")
    a = random_prompt(rng, 200, mla_model)
    b = random_prompt(rng, 200, mla_model)
    rb = answer_with_foreign_kv_after_checks(mla_pd, mla_oracle, a, b, MAX_NEW)
    assert mla_oracle.judge(rb, b, MAX_NEW) is Verdict.WRONG_CONTENT, \
        "the oracle missed foreign MLA KV"
    _, rc = direct_pd_generate(mla_pd, b, MAX_NEW)
    mla_oracle.assert_identical(rc, b, MAX_NEW, what="same prompt, no fault")
