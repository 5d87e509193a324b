"""The shipped models: parameter counts full-rank and after the default hybrid factorization,
and forward + backward after factorization."""

import functools

import pytest
import torch
from torch import nn

from gradwire.lowrank import factorize
from gradwire.harness.models import MODELS, build_model


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.cache
def pair(name: str) -> tuple[nn.Module, nn.Module]:
    """(full-rank model, default factorization), built once per test session: SVDs of the big
    models take seconds on a busy CPU."""
    torch.manual_seed(0)
    model = build_model(name)
    return model, factorize(model, rank_ratio=0.25)


# (full, factorized at rank_ratio 0.25 with the model's own hybrid policy)
EXPECTED_PARAMS = {
    # Pufferfish's figures exactly: no BN after the stem conv (stem_bn=True adds 128), and the
    # stem, layer1.0, the 1x1 shortcuts and fc stay full-rank; every other 3x3 conv gets r = c_out/4.
    "resnet18": (11_173_834, 3_336_138),
    # Pufferfish's figures exactly: convs 1-9 and the last Linear stay full-rank.
    "vgg19": (20_560_330, 8_370_634),
    "cnn": (151_402, 44_394),
    # The tied embedding/decoder (2.57M) dominates and stays; the LSTM halves (1.05M -> 0.53M).
    "lstm": (3_622_672, 3_098_384),
    # Token embeddings (2.56M) stay; encoder layers 1-3 shrink.
    "transformer": (5_754_378, 4_279_818),
    # The input layer stays (526,336); 2048x2048 gets r = 512 (2,099,200); the 10-way head r = 3.
    "mlp": (4_743_178, 2_631_720),
    # The byte-level causal LM: blocks.0 and the head stay full-rank (its docstring has the breakdown).
    "gpt": (509_248, 288_064),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_counts(name: str) -> None:
    model, factorized = pair(name)
    full, low = EXPECTED_PARAMS[name]
    assert count(model) == full
    assert count(factorized) == low


def test_resnet18_stem_bn_option_gives_the_common_cifar_count() -> None:
    assert count(build_model("resnet18", stem_bn=True)) == 11_173_962


def test_resnet18_hybrid_policy_matches_the_paper() -> None:
    low = pair("resnet18")[1]
    kept = [d.name for d in low.lowrank_decisions if not d.factorized]
    assert kept == ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.shortcut.0",
                    "layer3.0.shortcut.0", "layer4.0.shortcut.0", "fc"]
    assert low.layer4[1].conv2.ranks == (128,)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_backward_after_factorization(name: str) -> None:
    model = pair(name)[1]
    batch = model.example_input(2)
    if name in ("lstm", "transformer"):
        batch = batch[:, :6]  # short sequences keep the test quick
    logits = model(batch)
    expected = {"lstm": (2, 6, 10_000), "gpt": (2, 128, 256)}.get(name, (2, 10))
    assert logits.shape == expected
    logits.float().logsumexp(-1).sum().backward()
    factorized = {d.name for d in model.lowrank_decisions if d.factorized}
    grads = [p.grad for name_, p in model.named_parameters() if any(name_.startswith(f + ".") for f in factorized)]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_cnn_takes_mnist_and_digits_sizes() -> None:
    model = build_model("cnn").eval()
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert build_model("cnn", num_classes=4, in_channels=3)(torch.randn(1, 3, 16, 16)).shape == (1, 4)


def test_unknown_model_is_an_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="model='resnet50'.*cnn, resnet18, vgg19, lstm, transformer"):
        build_model("resnet50")


def test_lstm_tie_weights_needs_equal_sizes() -> None:
    with pytest.raises(ValueError, match="tie_weights"):
        build_model("lstm", embed_dim=64, hidden_size=32)
    assert count(build_model("lstm", vocab_size=50, embed_dim=8, hidden_size=16, tie_weights=False)) > 0


@pytest.mark.parametrize("name", ["resnet18", "vgg19"])
@pytest.mark.parametrize("size", [8, 28])
def test_cifar_models_take_small_grayscale_images(name: str, size: int) -> None:
    model = build_model(name, in_channels=1, image_size=size).eval()
    with torch.no_grad():
        assert model(model.example_input(2)).shape == (2, 10)
