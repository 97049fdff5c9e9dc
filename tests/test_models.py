"""The GPT family: presets match the published parameter counts, counted three ways."""

from __future__ import annotations

import pytest
import torch

from labkit.models import GPT, PRESETS, GPTConfig, count_params_meta, gpt_loss, lm_loss, preset

# Published counts (GPT-2 with the 50,257 vocabulary and 1,024 positions, tied head; the
# 1.3B row is GPT-3 XL's shape with 16 heads of 128 and 2,048 positions).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "gpt2-1.3b": 1_315_723_264,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_counts_from_config_and_meta_module(name: str) -> None:
    cfg = preset(name)
    assert cfg.num_params() == PUBLISHED[name]
    assert count_params_meta(cfg) == PUBLISHED[name]  # the module, built without memory


def test_formula_equals_module_for_tiny_shapes_tied_and_untied() -> None:
    for cfg in (
        PRESETS["tiny"],
        PRESETS["tiny"].with_(tie_weights=False),
        GPTConfig(n_layer=3, n_embd=48, n_head=6),
    ):
        model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), cfg


def test_bad_shapes_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="n_embd=100 must be divisible by n_head=3"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt5'"):
        preset("gpt5")
    with pytest.raises(ValueError, match="attention='flash'"):
        GPTConfig(attention="flash")


def test_sdpa_and_explicit_attention_agree_and_loss_is_outside_forward() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
    a = GPT(cfg)
    b = GPT(cfg.with_(attention="explicit"))
    b.load_state_dict(a.state_dict())
    idx, tgt = torch.randint(0, 65, (3, 16)), torch.randint(0, 65, (3, 16))
    la, lb = a(idx), b(idx)
    assert la.shape == (3, 16, 65)  # forward returns logits
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpt_loss(a, idx, tgt), lm_loss(lb, tgt), rtol=1e-5, atol=1e-5)
    # the stages a pipeline cuts: embed -> blocks -> logits is the whole forward
    x = a.embed(idx)
    for blk in a.blocks:
        x = blk(x)
    assert torch.equal(a.logits(x), la)


def test_causal_no_future_leak() -> None:
    torch.manual_seed(0)
    for attention in ("sdpa", "explicit"):
        model = GPT(
            GPTConfig(
                vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, attention=attention
            )
        )
        idx = torch.randint(0, 11, (1, 8))
        changed = idx.clone()
        changed[0, 5] = (idx[0, 5] + 1) % 11
        torch.testing.assert_close(model(idx)[0, :5], model(changed)[0, :5])
        assert not torch.allclose(model(idx)[0, 5], model(changed)[0, 5])
