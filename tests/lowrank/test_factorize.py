"""factorize: which layers it replaces, and its validation of options."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradwire.lowrank import LowRankConv2d, LowRankLinear, factorize, find_candidates


def small_net() -> nn.Sequential:
    return nn.Sequential(OrderedDict(
        stem=nn.Conv2d(3, 16, 3, padding=1),
        body=nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)),
        pool=nn.AdaptiveAvgPool2d(1),
        flat=nn.Flatten(),
        hidden=nn.Linear(32, 64),
        head=nn.Linear(64, 10),
    ))


def kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(module).__name__ for name, module in find_candidates(model)}


def test_default_policy_of_a_plain_model_keeps_first_and_last_layer() -> None:
    net = small_net()
    low = factorize(net)
    decisions = {d.name: d for d in low.lowrank_decisions}
    assert [name for name, d in decisions.items() if d.factorized] == ["body.0", "body.2", "hidden"]
    assert "keep_full" in decisions["stem"].reason and "keep_full" in decisions["head"].reason
    assert isinstance(low.body[0], LowRankConv2d) and isinstance(low.hidden, LowRankLinear)
    assert low(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_copy_by_default_inplace_on_request() -> None:
    net = small_net()
    before = {name: p.clone() for name, p in net.named_parameters()}
    low = factorize(net, keep_full=())
    assert low is not net and isinstance(net.body[0], nn.Conv2d)
    assert all(torch.equal(p, before[name]) for name, p in net.named_parameters())
    stem_weight = net.stem.weight
    same = factorize(net, keep_full=["stem", "head"], inplace=True)
    assert same is net and isinstance(net.body[0], LowRankConv2d) and net.stem.weight is stem_weight


def test_decisions_account_for_every_parameter_removed() -> None:
    net = small_net()
    low = factorize(net, rank_ratio=0.25, keep_full=())
    removed = sum(d.params_before - d.params_after for d in low.lowrank_decisions)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(net) - count(low) == removed > 0
    body = next(d for d in low.lowrank_decisions if d.name == "body.0")
    assert body.shape == (32, 16, 3, 3) and body.ranks == (8,) and body.kind == "Conv2d"
    assert body.params_after == 16 * 9 * 8 + 8 * 32 + 32


def test_keep_full_patterns_and_container_names() -> None:
    low = factorize(small_net(), keep_full=["body", "h*"])
    factorized = [d.name for d in low.lowrank_decisions if d.factorized]
    assert factorized == ["stem"]
    low = factorize(small_net(), keep_full="stem")  # a single name, not its characters
    assert not low.lowrank_decisions[0].factorized and low.lowrank_decisions[1].factorized


def test_unknown_keep_full_name_is_an_error_listing_valid_names() -> None:
    with pytest.raises(ValueError, match=r"keep_full.*'stemm'.*valid names include: stem, body.0"):
        factorize(small_net(), keep_full=["stemm"])
    factorize(small_net(), keep_full=["nothing.*"])  # a pattern may match nothing


@pytest.mark.parametrize("ratio", [0, 0.0, -0.25, 1.01, float("nan"), float("inf"), True, "0.5", None])
def test_rank_ratio_outside_zero_one_is_an_error(ratio: object) -> None:
    with pytest.raises(ValueError, match="rank_ratio"):
        factorize(small_net(), rank_ratio=ratio)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_min_params_is_an_error(bad: object) -> None:
    with pytest.raises(ValueError, match="min_params"):
        factorize(small_net(), min_params=bad)


def test_min_params_keeps_small_layers() -> None:
    low = factorize(small_net(), keep_full=(), min_params=5_000)
    reasons = {d.name: d.reason for d in low.lowrank_decisions}
    assert reasons["body.0"] == "min_params (4640 < 5000)"
    assert all(reasons[name].startswith("min_params") for name in ("stem", "hidden", "head"))
    assert reasons["body.2"] == "factorized"  # 9,248 parameters


def test_layer_without_savings_stays_full_rank() -> None:
    reasons = {d.name: d.reason for d in factorize(small_net(), rank_ratio=0.7, keep_full=()).lowrank_decisions}
    assert reasons["body.0"] == "factorized"  # rank 22: 3,872 < 4,640 parameters
    assert reasons["hidden"] == "no parameter savings at rank 22"  # 2,112 + 64 > 2,048 + 64
    with pytest.raises(ValueError, match="no layer was factorized.*no parameter savings"):
        factorize(small_net(), rank_ratio=0.9, keep_full=())


def test_model_without_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="no Conv2d, Linear, HF Conv1D, LSTM or MultiheadAttention"):
        factorize(nn.Sequential(nn.ReLU(), nn.Flatten()))
    with pytest.raises(ValueError, match="keep_full"):
        factorize(small_net(), keep_full=["*"])


def test_grouped_conv_and_shared_weights_stay_full_rank() -> None:
    net = nn.Sequential(nn.Conv2d(16, 32, 3, groups=4), nn.Conv2d(32, 64, 3), nn.Linear(64, 64), nn.Linear(64, 64))
    net[3].weight = net[2].weight
    reasons = {d.name: d.reason for d in factorize(net, keep_full=()).lowrank_decisions}
    assert reasons["0"].startswith("grouped conv")
    assert reasons["1"] == "factorized"
    assert reasons["2"] == reasons["3"] == "weights shared with another layer"


def test_wrapped_model_is_refused() -> None:
    with pytest.raises(ValueError, match="ddp.module"):
        factorize(nn.DataParallel(small_net()))


def test_factorized_layers_are_not_candidates_again() -> None:
    low = factorize(small_net(), keep_full=())
    assert kinds(low) == {}
    with pytest.raises(ValueError, match="no Conv2d"):
        factorize(low, keep_full=())
    partly = factorize(small_net())  # stem and head kept: they can be factorized later
    assert kinds(partly) == {"stem": "Conv2d", "head": "Linear"}


def test_dtype_and_device_follow_the_weights() -> None:
    net = small_net().double()
    low = factorize(net, keep_full=())
    assert {p.dtype for p in low.parameters()} == {torch.float64}
    assert low(torch.randn(1, 3, 8, 8, dtype=torch.float64)).dtype == torch.float64
