"""The byte-level GPT: its size, causality, seeded init, Pufferfish factorization, and that it learns."""

from __future__ import annotations

import pytest
import torch

from gradwire.harness.models import MODELS, ByteGPT, build_model

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_default_has_the_documented_parameter_count() -> None:
    model = build_model("gpt")
    assert MODELS["gpt"] is ByteGPT and isinstance(model, ByteGPT)
    d, layers, ff, vocab, context = 96, 4, 384, 256, 128
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
    assert _count(model) == vocab * d + context * d + layers * block + 2 * d + (d * vocab + vocab) == 509_248
    assert model(model.example_input(3)).shape == (3, 128, 256)


def test_a_later_byte_never_changes_an_earlier_logit() -> None:
    model = build_model("gpt", **TINY).eval()
    tokens = torch.randint(256, (2, 128), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 70] = (changed[:, 70] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :70], after[:, :70], rtol=0, atol=0)
    assert (before[:, 70:] - after[:, 70:]).abs().amax(dim=-1).min() > 1e-6  # every later position sees it
    with pytest.raises(ValueError, match="longer than context=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_init_depends_on_the_seed_only() -> None:
    torch.manual_seed(123)
    first = build_model("gpt", seed=5, **TINY)
    torch.manual_seed(456)  # a different global RNG state changes nothing
    second = build_model("gpt", seed=5, **TINY)
    other = build_model("gpt", seed=6, **TINY)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    assert not torch.equal(first.head.weight, other.head.weight)
    assert first.blocks[0].fc2.weight.std() < first.blocks[0].fc1.weight.std()  # the scaled residual init
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ByteGPT(d_model=30, n_heads=4)


def test_pufferfish_factorizes_every_block_but_the_first() -> None:
    from gradwire.lowrank import factorize

    model = build_model("gpt")
    small = factorize(model, rank_ratio=0.25)
    factorized = {d.name for d in small.lowrank_decisions if d.factorized}
    assert factorized == {f"blocks.{i}.{name}" for i in (1, 2, 3) for name in ("attn.qkv", "attn.proj", "fc1", "fc2")}
    assert _count(small) < 0.6 * _count(model)
    assert small(model.example_input(2)).shape == (2, 128, 256)


def test_the_workload_learns_in_30_steps() -> None:
    from gradwire.harness.simulate import simulate
    from gradwire.harness.workloads import build_workload

    workload = build_workload("gpt", "pystdlib:max_bytes=131072,held_out_bytes=8192", model_options=TINY)
    result = simulate(1, 30, batch_size=8, lr=1e-2, eval_every=30, workload=workload)
    initial, final = result.evaluations[0]["held_out_loss"], result.held_out_loss
    assert abs(initial - torch.log(torch.tensor(256.0)).item()) < 0.1  # ~uniform over bytes at init
    assert final < initial - 1.5, result.evaluations
    assert sum(result.train_loss[-5:]) / 5 < sum(result.train_loss[:5]) / 5 - 1.0
