"""Each low-rank layer: exact at full rank, the optimal (Eckart-Young) error at rank r."""

import math

import pytest
import torch
from torch import nn

from gradwire.lowrank import (LowRankConv2d, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention, factorize,
                              rank_for, svd_factors)


def full_rank(module: nn.Module) -> nn.Module:
    return factorize(module, rank_ratio=1.0, keep_full=(), require_savings=False)


def optimal_error(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """sqrt(sum of the discarded squared singular values), per matrix of a batch."""
    return torch.linalg.svdvals(matrix)[..., rank:].square().sum(-1).sqrt()


def test_rank_rounds_half_up_and_stays_in_range() -> None:
    assert rank_for(10, 0.25) == 3
    assert rank_for(64, 0.25) == 16
    assert rank_for(3, 0.01) == 1
    assert rank_for(7, 1.0) == 7


def test_svd_factors_shapes_and_product() -> None:
    weight = torch.randn(6, 10, dtype=torch.float64)
    first, second = svd_factors(weight, 6)
    assert first.shape == (6, 10) and second.shape == (6, 6)
    torch.testing.assert_close(second @ first, weight)
    tall = torch.randn(3, 9, 4, dtype=torch.float64)
    first, second = svd_factors(tall, 2)
    assert first.shape == (3, 2, 4) and second.shape == (3, 9, 2)
    error = torch.linalg.matrix_norm(tall - second @ first)
    torch.testing.assert_close(error, optimal_error(tall, 2))


@pytest.mark.parametrize("options", [
    {"stride": 2, "padding": 1},
    {"dilation": 2, "padding": 2, "bias": False},
    {"padding": "same", "padding_mode": "reflect"},
])
def test_conv2d_exact_at_full_rank(options: dict) -> None:
    conv = nn.Conv2d(4, 6, 3, **options).double()
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    low = full_rank(conv)
    assert isinstance(low, LowRankConv2d) and low.rank == 6
    assert low.first.weight.shape == (6, 4, 3, 3) and low.second.weight.shape == (6, 6, 1, 1)
    assert low.first.bias is None and (low.second.bias is not None) == (conv.bias is not None)
    torch.testing.assert_close(low(x), conv(x))


def test_conv2d_error_is_optimal_at_rank_r() -> None:
    conv = nn.Conv2d(8, 16, 3, padding=1)
    low = factorize(conv, rank_ratio=0.25, keep_full=())
    assert low.rank == 4
    error = torch.linalg.matrix_norm((conv.weight - low.weight_product()).flatten(1))
    torch.testing.assert_close(error, optimal_error(conv.weight.detach().flatten(1), 4), rtol=1e-4, atol=1e-5)


def test_conv2d_extra_bn_sits_between_the_factors() -> None:
    low = factorize(nn.Conv2d(8, 16, 3), rank_ratio=0.25, keep_full=(), extra_bn=True)
    assert isinstance(low.mid_bn, nn.BatchNorm2d) and low.mid_bn.num_features == 4
    assert low(torch.randn(2, 8, 5, 5)).shape == (2, 16, 3, 3)


def test_linear_exact_at_full_rank_and_optimal_at_rank_r() -> None:
    linear = nn.Linear(12, 7).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    low = full_rank(linear)
    assert isinstance(low, LowRankLinear) and low.first.bias is None
    torch.testing.assert_close(low(x), linear(x))
    low = factorize(linear, rank_ratio=0.3, keep_full=())
    assert low.rank == 2  # round(0.3 * 7)
    error = torch.linalg.matrix_norm(linear.weight - low.weight_product())
    torch.testing.assert_close(error, optimal_error(linear.weight.detach(), 2))


@pytest.mark.parametrize("batch_first,bidirectional", [(True, False), (False, True)])
def test_lstm_exact_at_full_rank(batch_first: bool, bidirectional: bool) -> None:
    lstm = nn.LSTM(5, 6, num_layers=2, batch_first=batch_first, bidirectional=bidirectional).double()
    directions = 2 if bidirectional else 1
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    hx = (torch.randn(2 * directions, 3 if batch_first else 4, 6, dtype=torch.float64),
          torch.randn(2 * directions, 3 if batch_first else 4, 6, dtype=torch.float64))
    low = full_rank(lstm)
    assert isinstance(low, LowRankLSTM)
    for got, want in zip(low(x, hx), lstm(x, hx)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(low(x)[0], lstm(x)[0])
    torch.testing.assert_close(low(x[0])[0], lstm(x[0])[0])  # unbatched


def test_lstm_gate_errors_are_optimal_at_rank_r() -> None:
    lstm = nn.LSTM(16, 8, num_layers=2)
    low = factorize(lstm, rank_ratio=0.25, keep_full=())
    assert low.ranks == (2, 2, 2)
    for layer in range(2):
        for kind in ("ih", "hh"):
            dense = getattr(lstm, f"weight_{kind}_l{layer}").detach()
            gates = (dense - low.gate_weight(kind, layer)).reshape(4, 8, -1)
            torch.testing.assert_close(torch.linalg.matrix_norm(gates), optimal_error(dense.reshape(4, 8, -1), 2),
                                       rtol=1e-4, atol=1e-5)


def test_lstm_backward_reaches_every_factor() -> None:
    low = factorize(nn.LSTM(8, 8, num_layers=2, batch_first=True), rank_ratio=0.25, keep_full=())
    output, (h, c) = low(torch.randn(2, 5, 8))
    (output.sum() + h.sum() + c.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in low.parameters())


def _masks(batch: int, target: int, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.ones(target, source, dtype=torch.bool).triu(1)
    return padding, causal


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("average", [True, False])
def test_attention_exact_at_full_rank(batch_first: bool, average: bool) -> None:
    attention = nn.MultiheadAttention(8, 2, batch_first=batch_first).double().eval()
    low = full_rank(attention)
    assert isinstance(low, LowRankMultiheadAttention)
    shape = (3, 5, 8) if batch_first else (5, 3, 8)
    q, kv = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    padding, causal = _masks(3, 5, 5)
    for kwargs in ({}, {"key_padding_mask": padding, "attn_mask": causal}, {"attn_mask": causal.double() * -3.0}):
        want = attention(q, kv, kv, average_attn_weights=average, **kwargs)
        got = low(q, kv, kv, average_attn_weights=average, **kwargs)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        fast = low(q, kv, kv, need_weights=False, **kwargs)
        assert fast[1] is None
        torch.testing.assert_close(fast[0], want[0])


def test_attention_with_other_key_and_value_sizes_unbatched() -> None:
    attention = nn.MultiheadAttention(8, 4, kdim=6, vdim=5).double().eval()
    low = full_rank(attention)
    q, k, v = (torch.randn(4, n, dtype=torch.float64) for n in (8, 6, 5))
    for got, want in zip(low(q, k, v), attention(q, k, v)):
        torch.testing.assert_close(got, want)


def test_attention_projection_errors_are_optimal_at_rank_r() -> None:
    attention = nn.MultiheadAttention(16, 4)
    low = factorize(attention, rank_ratio=0.25, keep_full=())
    assert low.ranks == (4, 4, 4, 4)
    dense = list(attention.in_proj_weight.detach().chunk(3)) + [attention.out_proj.weight.detach()]
    for weight, proj in zip(dense, (low.q_proj, low.k_proj, low.v_proj, low.out_proj)):
        error = torch.linalg.matrix_norm(weight - proj.weight_product())
        torch.testing.assert_close(error, optimal_error(weight, 4), rtol=1e-4, atol=1e-5)


def test_transformer_encoder_layer_exact_at_full_rank() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double().eval()
    low = full_rank(layer)
    assert isinstance(low.self_attn, LowRankMultiheadAttention)
    assert isinstance(low.linear1, LowRankLinear) and isinstance(low.linear2, LowRankLinear)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    padding, causal = _masks(3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(low(x, src_key_padding_mask=padding), layer(x, src_key_padding_mask=padding))
        torch.testing.assert_close(low(x, src_mask=causal), layer(x, src_mask=causal))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # from the full-rank original
def test_transformer_encoder_with_nested_tensors_enabled_still_runs() -> None:
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                    num_layers=2).double().eval()
    low = factorize(encoder, rank_ratio=1.0, keep_full=("layers.0",), require_savings=False)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    padding, _ = _masks(3, 5, 5)
    with torch.no_grad():
        got, want = low(x, src_key_padding_mask=padding), encoder(x, src_key_padding_mask=padding)
    # The fused path zeroes padded positions; compare the real tokens.
    torch.testing.assert_close(got[~padding], want[~padding])
    assert math.isfinite(float(got[~padding].sum()))


def test_low_rank_conv_keeps_the_dense_layers_attributes() -> None:
    dense = nn.Conv2d(8, 16, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2), padding_mode="reflect")
    low = LowRankConv2d.from_dense(dense, 0.5)
    for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "padding_mode",
                 "groups"):
        assert getattr(low, name) == getattr(dense, name), name
