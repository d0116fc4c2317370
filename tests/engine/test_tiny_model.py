"""The end-to-end oracle's own check: in the tiny models the state-space layers carry the
prompt's context on their own, so a wrong Mamba/GDN state (a block of another request, a
state not restored after preemption) changes the greedy tokens the e2e tests compare.

The attention layers' outputs are zeroed and tokens 16-80 of a 300-token prompt replaced:
the next-token predictions at the prompt's last 16 positions must change for most of them.
And the models do not echo their input: two prompts that end in the same token get
different next tokens, and few next tokens are the prompt's last (Granite 4.0-H's tied
embeddings with its multipliers do exactly that at the stock initialisation).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)

# The families whose runs compare outputs under preemption or prefix caching.
FAMILIES = ["qwen3_next", "nemotron_h", "falcon_h1", "zamba2", "granitemoehybrid"]
ATTENTION_OUTPUTS = ("self_attn.o_proj.weight", "mixer.o_proj.weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_state_layers_carry_the_context(family: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_model import write_tiny_hybrid_model

    path = write_tiny_hybrid_model(tmp_path, family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    zeroed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ATTENTION_OUTPUTS):
                param.zero_()
                zeroed += 1
        assert zeroed > 0, "no attention output projection found"
        changed = []
        for seed in range(2):
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(3, 512, (1, 300), generator=gen)
            other = prompt.clone()
            other[0, 16:80] = torch.randint(3, 512, (64,), generator=gen)
            a = model(prompt).logits[0, -16:].argmax(-1)
            b = model(other).logits[0, -16:].argmax(-1)
            changed.append(int((a != b).sum()))
    assert min(changed) >= 8, changed


@pytest.mark.parametrize("family", FAMILIES)
def test_output_follows_the_context(family: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_model import write_tiny_hybrid_model

    path = write_tiny_hybrid_model(tmp_path, family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(3, 512, (8, 300), generator=gen)
    second = torch.randint(3, 512, (8, 300), generator=gen)
    second[:, -1] = first[:, -1]
    with torch.no_grad():
        logits = model(first).logits
        other = model(second).logits[:, -1].argmax(-1)
    predicted = logits.argmax(-1)  # (8, 300): the next token after every position
    differ = int((predicted[:, -1] != other).sum())
    assert differ >= 6, f"{differ} of 8 prompt pairs ending alike get different next tokens"
    echoes = int((predicted[:, -64:] == first[:, -64:]).sum())
    assert echoes <= 8 * 64 // 4, f"{echoes} of {8 * 64} next tokens repeat the last one"
