"""factorize on others' models: Hugging Face MobileNetV2 and GPT-2, built from small configs
(no downloads)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwire.lowrank import LowRankConv1D, factorize

transformers = pytest.importorskip("transformers")


def test_mobilenet_v2_runs_after_factorize() -> None:
    torch.manual_seed(0)
    model = transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
        image_size=32, depth_multiplier=0.35, num_labels=5)).eval()
    low = factorize(model, rank_ratio=0.5, keep_full=())
    decisions = low.lowrank_decisions
    assert sum(d.factorized for d in decisions) > 10
    assert any(d.reason.startswith("grouped conv") for d in decisions)  # depthwise convs stay full-rank
    images = torch.randn(2, 3, 32, 32)
    assert low(pixel_values=images).logits.shape == (2, 5)  # HF's "same" padding reads conv.stride


def test_gpt2_conv1d_layers_are_candidates_and_exact_at_full_rank() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    full = factorize(model, rank_ratio=1.0, keep_full=(), require_savings=False)
    kinds = {d.kind for d in full.lowrank_decisions if d.factorized}
    assert kinds == {"Conv1D"}  # c_attn, c_proj, c_fc, mlp c_proj of both blocks
    assert sum(isinstance(m, LowRankConv1D) for m in full.modules()) == 8
    assert full.transformer.h[0].mlp.c_fc.nf == 4 * 32 and full.transformer.h[0].mlp.c_fc.nx == 32
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(full(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-4)
    small = factorize(model, rank_ratio=0.25, keep_full=())
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())
    assert small(tokens).logits.shape == (2, 16, 128)


def test_nothing_factorized_names_the_skipped_types_and_gives_only_useful_advice() -> None:
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 16))
    with pytest.raises(ValueError) as error:
        factorize(model, keep_full=["1"])
    text = str(error.value)
    assert "Linear x1 (1): keep_full '1'" in text and "keep_full=() factorizes every candidate" in text
    assert "Embedding x1 (a lookup table" in text
    tied = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError) as error:
        factorize(tied, keep_full=())
    text = str(error.value)
    assert "Linear x2 (0, 1): weights shared with another layer" in text
    assert "cannot" not in text and "none of these can be factorized by changing the options" in text
