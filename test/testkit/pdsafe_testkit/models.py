"""Tiny random-weight models of other architectures than the MHA test model, built on demand.

The committed test model (``test/assets/tiny-copy-llama``) is MHA. The incident's model family
keeps MLA latent KV (``MLATokenToKVPool``), so :func:`tiny_mla_model` writes a two-layer
``DeepseekV2ForCausalLM`` with seeded random weights, served by the CPU engine like the test
model (the absorbed MLA path on ``torch_native``: ``sglang.pdsafe.cpu_compat``). Nothing in it
is tuned: the content oracle compares a PD answer with the co-located server's answer of the
same weights, and :func:`tiny_mla_model`'s weights are large enough that one changed early
token changes the greedy answer (the end-to-end test checks that, so an answer that ignored
the KV could not pass for identical).

Layout written down (HF DeepSeek-V2 names, float32): no q LoRA (``q_proj``), ``kv_lora_rank``
64, ``qk_nope_head_dim`` 32, ``qk_rope_head_dim`` 16, ``v_head_dim`` 32, 4 heads, hidden 128,
dense MLPs in both layers (``first_k_dense_replace`` = layers), vocabulary and tokenizer of the
MHA test model, ``deepseek_yarn`` rope with factor 1 (the only rope upstream's CPU path builds
for this family).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pdsafe_testkit.servers import DEFAULT_MODEL

#: The latent row the decode's MLA pool stores per token and layer: kv_lora_rank + qk_rope.
MLA_KV_LORA_RANK = 64
MLA_ROPE_DIM = 16
_SEED = 20261207


def tiny_mla_config(vocab_size: int) -> dict:
    """The ``config.json`` of :func:`tiny_mla_model`."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 1,
        "kv_lora_rank": MLA_KV_LORA_RANK, "q_lora_rank": None,
        "qk_rope_head_dim": MLA_ROPE_DIM, "v_head_dim": 32, "qk_nope_head_dim": 32,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
        "hidden_act": "silu", "rope_theta": 10000.0, "attention_bias": False,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.0,
        "seq_aux": False, "use_cache": True,
    }


def tiny_mla_model(out: Path, base: Path = DEFAULT_MODEL) -> Path:
    """Write the tiny MLA model into ``out`` (created; its tokenizer copied from ``base``) and
    return ``out``. Deterministic for a given torch build (seeded CPU generator)."""
    import torch
    from safetensors.torch import save_file

    base_cfg = json.loads((base / "config.json").read_text())
    cfg = tiny_mla_config(int(base_cfg["vocab_size"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = torch.Generator().manual_seed(_SEED)
    h, heads, vocab, inter = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"],
                              cfg["intermediate_size"])
    nope, rope, v, rank = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                           cfg["kv_lora_rank"])

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.08

    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h),
         "lm_head.weight": w(vocab, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(heads * (nope + rope), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(rank + rope, h),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(rank),
            p + "self_attn.kv_b_proj.weight": w(heads * (nope + v), rank),
            p + "self_attn.o_proj.weight": w(h, heads * v),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
    save_file({k: x.contiguous() for k, x in t.items()}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pdsafe_testkit.models OUT``: write the tiny MLA model into OUT (for
    ``PDSAFE_MODEL=OUT``: the benchmark and the harness then serve it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pdsafe_testkit.models", description=main.__doc__)
    ap.add_argument("out", type=Path, help="directory to write the model into")
    a = ap.parse_args(argv)
    print(tiny_mla_model(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
