"""Low-rank replacements for dense layers, initialised from the dense weights by truncated SVD.

A dense weight ``W`` (out x in; a conv kernel is read as c_out x c_in*k*k) is split as
``W = U S V^T`` and truncated to rank ``r``::

    first  = sqrt(S_r) V_r^T      (r x in)     applied first
    second = U_r sqrt(S_r)        (out x r)    applied second

so ``second @ first`` is the best rank-r approximation of ``W`` in Frobenius norm
(Eckart-Young) and equals ``W`` exactly at full rank. Splitting ``sqrt(S)`` evenly keeps both
factors on the same scale, which matters because both go on being trained.

Every class here has ``from_dense(layer, rank_ratio)`` (the factors are built on the dense
weight's device and in its dtype) and a ``ranks`` tuple. Rank ``r = rank_for(full_rank, ratio)``
with ``full_rank = min(out, in)`` per factorized matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rank_for(full_rank: int, rank_ratio: float) -> int:
    """``max(1, round(rank_ratio * full_rank))``, rounding halves up (2.5 -> 3), at most ``full_rank``."""
    return max(1, min(full_rank, math.floor(rank_ratio * full_rank + 0.5)))


def svd_factors(weight: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Split ``weight`` into the two factors of its best rank-``rank`` approximation.

    ``second @ first`` is the optimal rank-``rank`` approximation of each matrix in the batch
    (the module docstring's split of ``sqrt(S)``). Computed on ``weight``'s device in float32
    (float64 stays float64; LAPACK has no half precision).

    Args:
        weight: (..., out, in), a batch of matrices; not modified.
        rank: ``1 <= rank <= min(out, in)``.

    Returns:
        ``first`` (..., rank, in) and ``second`` (..., out, rank), in ``weight``'s dtype.
    """
    matrix = weight.detach()
    work = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
    u, s, vh = _thin_svd(work)
    root = s[..., :rank].sqrt()
    first = root.unsqueeze(-1) * vh[..., :rank, :]
    second = u[..., :rank] * root.unsqueeze(-2)
    return first.to(matrix.dtype), second.to(matrix.dtype)


def _thin_svd(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(matrix, full_matrices=False)``, via a QR step for non-square matrices.

    Conv kernels are very wide (c_out x c_in*k*k); an SVD of their small square QR factor is
    several times faster than LAPACK's SVD of the whole matrix, and as accurate.
    """
    rows, cols = matrix.shape[-2:]
    if rows < cols:  # W = R^T Q^T with W^T = QR
        q, r = torch.linalg.qr(matrix.mT)
        u, s, vh = torch.linalg.svd(r.mT)
        return u, s, vh @ q.mT
    if rows > cols:  # W = QR
        q, r = torch.linalg.qr(matrix)
        u, s, vh = torch.linalg.svd(r)
        return q @ u, s, vh
    return torch.linalg.svd(matrix)


def _copy_(target: Tensor, source: Tensor, requires_grad: bool) -> None:
    with torch.no_grad():
        target.copy_(source)
    target.requires_grad_(requires_grad)


class LowRankLinear(nn.Module):
    """``x (..., in_features) -> (..., out_features)`` through rank ``rank``.

    ``first = Linear(in_features, rank, bias=False)``, ``second = Linear(rank, out_features,
    bias)``; the original bias lives on ``second``. ``rank * (in + out)`` weights instead of
    ``in * out``.

    Args:
        in_features: as ``nn.Linear``'s.
        out_features: as ``nn.Linear``'s.
        rank: the inner dimension.
        bias: whether ``second`` has a bias.
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.first = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.second = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, rank: int) -> "LowRankLinear":
        """Factorize a dense ``weight`` (out, in) with optional ``bias`` (out,)."""
        module = cls(weight.shape[1], weight.shape[0], rank, bias=bias is not None,
                     device=weight.device, dtype=weight.dtype)
        first, second = svd_factors(weight, rank)
        _copy_(module.first.weight, first, weight.requires_grad)
        _copy_(module.second.weight, second, weight.requires_grad)
        if bias is not None:
            _copy_(module.second.bias, bias, bias.requires_grad)
        return module

    @classmethod
    def from_dense(cls, linear: nn.Linear, rank_ratio: float) -> "LowRankLinear":
        """The SVD-initialised pair for ``linear``, at rank ``rank_for(min(out, in), rank_ratio)``.

        Args:
            linear: the dense layer; not modified.
            rank_ratio: rank over full rank, in (0, 1].

        Returns:
            A pair on ``linear``'s device and in its dtype, ``requires_grad`` as its weight's.
        """
        rank = rank_for(min(linear.out_features, linear.in_features), rank_ratio)
        return cls.from_weight(linear.weight, linear.bias, rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        """``(rank,)``."""
        return (self.rank,)

    def weight_product(self) -> Tensor:
        """The dense (out, in) weight this pair computes."""
        return self.second.weight @ self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        """``second(first(x))``: (..., in_features) -> (..., out_features)."""
        return self.second(self.first(x))


class LowRankConv1D(LowRankLinear):
    """Replacement of Hugging Face's ``Conv1D`` (GPT-2 and relatives): a Linear whose weight is
    stored transposed, (nx, nf) = (in, out). The pair computes the same ``x (..., nx) -> (..., nf)``;
    ``nx`` and ``nf`` are kept for code that reads them."""

    @property
    def nx(self) -> int:
        """Input features, as ``Conv1D`` names them."""
        return self.in_features

    @property
    def nf(self) -> int:
        """Output features, as ``Conv1D`` names them."""
        return self.out_features

    @classmethod
    def from_dense(cls, conv1d: nn.Module, rank_ratio: float) -> "LowRankConv1D":
        """The SVD-initialised pair for a Hugging Face ``Conv1D`` (weight (nx, nf)); see
        :meth:`LowRankLinear.from_dense`."""
        nx, nf = conv1d.weight.shape
        return cls.from_weight(conv1d.weight.t(), conv1d.bias, rank_for(min(nx, nf), rank_ratio))


class LowRankConv2d(nn.Module):
    """``(N, C_in, H, W) -> (N, C_out, H', W')``: a k x k conv to ``rank`` channels, then a 1x1 conv.

    The first conv keeps the dense layer's stride, padding, dilation and padding mode (no bias);
    the 1x1 conv to ``C_out`` carries the original bias. The dense layer's attributes stay
    readable (``stride``, ``padding``, ``dilation``, ``kernel_size``, ``padding_mode``,
    ``groups``, ``in_channels``, ``out_channels``): code written for ``nn.Conv2d`` (e.g. Hugging
    Face's MobileNetV2 "same" padding) reads them.

    Args:
        in_channels: ``C_in``.
        out_channels: ``C_out``.
        kernel_size: ``(kh, kw)`` of the first conv.
        rank: channels between the two convs.
        stride: as ``nn.Conv2d``'s.
        padding: as ``nn.Conv2d``'s.
        dilation: as ``nn.Conv2d``'s.
        bias: whether the 1x1 conv has a bias.
        padding_mode: as ``nn.Conv2d``'s.
        extra_bn: put a ``BatchNorm2d(rank)`` (``mid_bn``) between the two (Pufferfish's option).
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    groups = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size: tuple[int, int], rank: int, *,
                 stride: tuple[int, int] = (1, 1), padding: "tuple[int, int] | str" = (0, 0),
                 dilation: tuple[int, int] = (1, 1), bias: bool = True, padding_mode: str = "zeros",
                 extra_bn: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.rank = in_channels, out_channels, rank
        self.first = nn.Conv2d(in_channels, rank, kernel_size, stride=stride, padding=padding,
                               dilation=dilation, bias=False, padding_mode=padding_mode,
                               device=device, dtype=dtype)
        self.mid_bn = nn.BatchNorm2d(rank, device=device, dtype=dtype) if extra_bn else None
        self.second = nn.Conv2d(rank, out_channels, 1, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, rank_ratio: float, extra_bn: bool = False) -> "LowRankConv2d":
        """The SVD-initialised pair for ``conv``, its kernel read as (C_out, C_in*kh*kw).

        Args:
            conv: the dense layer (``groups=1``); not modified.
            rank_ratio: rank over full rank ``min(C_out, C_in*kh*kw)``, in (0, 1].
            extra_bn: add ``mid_bn`` (freshly initialised: the pair then no longer equals ``conv``).

        Returns:
            A pair on ``conv``'s device and in its dtype.

        Raises:
            ValueError: a grouped convolution.
        """
        if conv.groups != 1:
            raise ValueError(f"only groups=1 convolutions can be factorized, got groups={conv.groups}")
        c_out, c_in, kh, kw = conv.weight.shape
        rank = rank_for(min(c_out, c_in * kh * kw), rank_ratio)
        module = cls(c_in, c_out, (kh, kw), rank, stride=conv.stride, padding=conv.padding,
                     dilation=conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                     extra_bn=extra_bn, device=conv.weight.device, dtype=conv.weight.dtype)
        first, second = svd_factors(conv.weight.reshape(c_out, -1), rank)
        _copy_(module.first.weight, first.reshape(rank, c_in, kh, kw), conv.weight.requires_grad)
        _copy_(module.second.weight, second.reshape(c_out, rank, 1, 1), conv.weight.requires_grad)
        if conv.bias is not None:
            _copy_(module.second.bias, conv.bias, conv.bias.requires_grad)
        return module

    @property
    def stride(self) -> tuple[int, ...]:
        """The dense layer's stride (the first conv's)."""
        return self.first.stride

    @property
    def padding(self) -> "tuple[int, ...] | str":
        """The dense layer's padding (the first conv's)."""
        return self.first.padding

    @property
    def dilation(self) -> tuple[int, ...]:
        """The dense layer's dilation (the first conv's)."""
        return self.first.dilation

    @property
    def kernel_size(self) -> tuple[int, ...]:
        """The dense layer's kernel size (the first conv's)."""
        return self.first.kernel_size

    @property
    def padding_mode(self) -> str:
        """The dense layer's padding mode (the first conv's)."""
        return self.first.padding_mode

    @property
    def ranks(self) -> tuple[int, ...]:
        """``(rank,)``."""
        return (self.rank,)

    def weight_product(self) -> Tensor:
        """The dense (C_out, C_in, k, k) kernel this pair computes (ignoring ``mid_bn``)."""
        first = self.first.weight
        return (self.second.weight.flatten(1) @ first.flatten(1)).reshape(self.out_channels, *first.shape[1:])

    def forward(self, x: Tensor) -> Tensor:
        """(N, C_in, H, W) -> (N, C_out, H', W'), as the dense conv."""
        x = self.first(x)
        if self.mid_bn is not None:
            x = self.mid_bn(x)
        return self.second(x)


class LowRankLSTM(nn.Module):
    """Drop-in for ``nn.LSTM`` (no ``proj_size``, no PackedSequence) whose 8 gate matrices per
    layer and direction (input-hidden and hidden-hidden for the i, f, g, o gates) are each
    factorized.

    Call and outputs as ``nn.LSTM``: ``input`` (T, N, in), or (N, T, in) if ``batch_first``, or
    unbatched (T, in); ``hx = (h_0, c_0)`` each (layers*directions, N, hidden). Returns
    ``output`` (T, N, directions*hidden) (batch-first as the input) and ``(h_n, c_n)``.

    Parameters per layer ``k`` and direction (suffix ``_reverse`` as in ``nn.LSTM``):
    ``weight_ih_l{k}_first`` (4*r_ih, in), ``weight_ih_l{k}_second`` (4, hidden, r_ih), the same
    for ``hh`` with r_hh, and ``bias_ih_l{k}`` / ``bias_hh_l{k}`` (4*hidden,). The four gates'
    first factors are stacked so that one matmul serves all gates.

    Args:
        input_size: as ``nn.LSTM``'s.
        hidden_size: as ``nn.LSTM``'s.
        num_layers: as ``nn.LSTM``'s.
        ranks_ih: the input-hidden rank of each layer (``num_layers`` ints).
        rank_hh: the hidden-hidden rank, every layer.
        bias: as ``nn.LSTM``'s.
        batch_first: as ``nn.LSTM``'s.
        dropout: as ``nn.LSTM``'s.
        bidirectional: as ``nn.LSTM``'s.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``ranks_ih`` does not have one rank per layer.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, ranks_ih: "list[int]", rank_hh: int, *,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if len(ranks_ih) != num_layers:
            raise ValueError(f"ranks_ih needs one rank per layer ({num_layers}), got {len(ranks_ih)}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, 0
        self.ranks_ih, self.rank_hh = list(ranks_ih), rank_hh
        directions = 2 if bidirectional else 1
        kw = {"device": device, "dtype": dtype}
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else hidden_size * directions
            for suffix in ("", "_reverse")[:directions]:
                name = f"l{layer}{suffix}"
                r = ranks_ih[layer]
                self.register_parameter(f"weight_ih_{name}_first", nn.Parameter(torch.empty(4 * r, layer_input, **kw)))
                self.register_parameter(f"weight_ih_{name}_second", nn.Parameter(torch.empty(4, hidden_size, r, **kw)))
                self.register_parameter(f"weight_hh_{name}_first",
                                        nn.Parameter(torch.empty(4 * rank_hh, hidden_size, **kw)))
                self.register_parameter(f"weight_hh_{name}_second",
                                        nn.Parameter(torch.empty(4, hidden_size, rank_hh, **kw)))
                if bias:
                    self.register_parameter(f"bias_ih_{name}", nn.Parameter(torch.zeros(4 * hidden_size, **kw)))
                    self.register_parameter(f"bias_hh_{name}", nn.Parameter(torch.zeros(4 * hidden_size, **kw)))
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # Same uniform(-1/sqrt(hidden), 1/sqrt(hidden)) as nn.LSTM, for modules built from scratch.
        bound = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.uniform_(-bound, bound)

    @classmethod
    def from_dense(cls, lstm: nn.LSTM, rank_ratio: float) -> "LowRankLSTM":
        """The SVD-initialised LSTM for ``lstm``, each gate's matrix factorized on its own.

        Args:
            lstm: the dense LSTM (``proj_size=0``); not modified.
            rank_ratio: rank over full rank (``min(hidden, layer input)``, ``hidden`` for hh), in
                (0, 1].

        Returns:
            A module on ``lstm``'s device and in its dtype.

        Raises:
            ValueError: ``proj_size > 0``.
        """
        if lstm.proj_size:
            raise ValueError("LSTMs with proj_size > 0 cannot be factorized")
        hidden, directions = lstm.hidden_size, 2 if lstm.bidirectional else 1
        layer_inputs = [lstm.input_size] + [hidden * directions] * (lstm.num_layers - 1)
        weight = lstm.weight_ih_l0
        module = cls(lstm.input_size, hidden, lstm.num_layers,
                     [rank_for(min(hidden, size), rank_ratio) for size in layer_inputs],
                     rank_for(hidden, rank_ratio), bias=lstm.bias, batch_first=lstm.batch_first,
                     dropout=lstm.dropout, bidirectional=lstm.bidirectional,
                     device=weight.device, dtype=weight.dtype)
        for layer in range(lstm.num_layers):
            for suffix in ("", "_reverse")[:directions]:
                name = f"l{layer}{suffix}"
                for kind, rank in (("ih", module.ranks_ih[layer]), ("hh", module.rank_hh)):
                    dense = getattr(lstm, f"weight_{kind}_{name}")
                    # (4*hidden, in) -> one (hidden, in) matrix per gate, factorized as a batch.
                    first, second = svd_factors(dense.reshape(4, hidden, -1), rank)
                    _copy_(getattr(module, f"weight_{kind}_{name}_first"), first.reshape(4 * rank, -1),
                           dense.requires_grad)
                    _copy_(getattr(module, f"weight_{kind}_{name}_second"), second, dense.requires_grad)
                    if lstm.bias:
                        dense_bias = getattr(lstm, f"bias_{kind}_{name}")
                        _copy_(getattr(module, f"bias_{kind}_{name}"), dense_bias, dense_bias.requires_grad)
        return module

    @property
    def ranks(self) -> tuple[int, ...]:
        """Input-hidden rank of each layer, then the hidden-hidden rank."""
        return (*self.ranks_ih, self.rank_hh)

    def gate_weight(self, kind: str, layer: int, reverse: bool = False) -> Tensor:
        """Dense (4*hidden, in) weight of ``kind`` ("ih" or "hh"), as ``nn.LSTM`` stores it."""
        name = f"weight_{kind}_l{layer}{'_reverse' if reverse else ''}"
        first, second = getattr(self, f"{name}_first"), getattr(self, f"{name}_second")
        return (second @ first.unflatten(0, (4, -1))).reshape(4 * self.hidden_size, -1)

    def forward(self, input: Tensor, hx: "tuple[Tensor, Tensor] | None" = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """As ``nn.LSTM.forward`` (shapes in the class docstring).

        Raises:
            TypeError: a ``PackedSequence`` input (pad the batch instead).
        """
        if isinstance(input, nn.utils.rnn.PackedSequence):
            raise TypeError("LowRankLSTM does not take PackedSequence inputs; pad the batch instead")
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if batched and self.batch_first:
            x = x.transpose(0, 1)
        batch = x.shape[1]
        directions = 2 if self.bidirectional else 1
        if hx is None:
            zeros = x.new_zeros(self.num_layers * directions, batch, self.hidden_size)
            h_0, c_0 = zeros, zeros
        else:
            h_0, c_0 = hx if batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                index = layer * directions + direction
                sequence = x if direction == 0 else x.flip(0)
                out, h, c = self._run(sequence, h_0[index], c_0[index], layer, direction == 1)
                outputs.append(out if direction == 0 else out.flip(0))
                h_n.append(h)
                c_n.append(c)
            x = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        output, h_n_t, c_n_t = x, torch.stack(h_n), torch.stack(c_n)
        if not batched:
            return output.squeeze(1), (h_n_t.squeeze(1), c_n_t.squeeze(1))
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (h_n_t, c_n_t)

    def _run(self, x: Tensor, h: Tensor, c: Tensor, layer: int, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
        """One layer and direction over ``x`` (T, N, in); returns (T, N, hidden), h, c."""
        name = f"l{layer}{'_reverse' if reverse else ''}"
        ih_first, ih_second = getattr(self, f"weight_ih_{name}_first"), getattr(self, f"weight_ih_{name}_second")
        hh_first, hh_second = getattr(self, f"weight_hh_{name}_first"), getattr(self, f"weight_hh_{name}_second")
        # Input contributions of all time steps at once, laid out (T, 4 gates, N, hidden), so
        # that only the recurrence loops: per step one matmul and one batched matmul over gates.
        x_low = (x @ ih_first.t()).unflatten(-1, (4, -1)).transpose(1, 2)  # (T, 4, N, r_ih)
        x_gates = x_low @ ih_second.mT
        if self.bias:
            bias = getattr(self, f"bias_ih_{name}") + getattr(self, f"bias_hh_{name}")
            x_gates = x_gates + bias.view(4, 1, self.hidden_size)
        hh_first_t, hh_second_t = hh_first.t(), hh_second.mT  # (hidden, 4*r_hh), (4, r_hh, hidden)
        outputs = []
        # unbind once: indexing x_gates[step] would make backward zero-fill a full-size
        # gradient at every step.
        for x_step in x_gates.unbind(0):
            h_low = (h @ hh_first_t).unflatten(-1, (4, -1)).transpose(0, 1)  # (4, N, r_hh)
            in_gate, forget_gate, cell_gate, out_gate = torch.baddbmm(x_step, h_low, hh_second_t).unbind(0)
            c = torch.sigmoid(forget_gate) * c + torch.sigmoid(in_gate) * torch.tanh(cell_gate)
            h = torch.sigmoid(out_gate) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs), h, c

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, ranks_ih={self.ranks_ih}, "
                f"rank_hh={self.rank_hh}, batch_first={self.batch_first}, bidirectional={self.bidirectional}")


def _additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean masks (True = may not attend) become 0/-inf; float masks are added as they are."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


class LowRankMultiheadAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` (same ``forward`` signature and outputs) whose
    Q, K, V and output projections are :class:`LowRankLinear` pairs (``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``). ``bias_k``/``bias_v``/``add_zero_attn`` are not supported.

    Shapes as ``nn.MultiheadAttention``: query (L, N, E), key/value (S, N, kdim/vdim), batch
    first when ``batch_first``, or unbatched (L, E); returns the output (like query) and the
    attention weights (N, L, S), or (N, heads, L, S) with ``average_attn_weights=False``, or
    None when ``need_weights=False``.

    Args:
        embed_dim: ``E``, divisible by ``num_heads``.
        num_heads: as ``nn.MultiheadAttention``'s.
        ranks: ranks of the q, k, v and output projections.
        dropout: on the attention weights, as ``nn.MultiheadAttention``'s.
        bias: whether the projections have biases.
        kdim: key features (default ``E``).
        vdim: value features (default ``E``).
        batch_first: as ``nn.MultiheadAttention``'s.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads``.
    """

    # PyTorch's fused encoder paths probe these; None/False send them down the regular path,
    # which calls this module's forward.
    in_proj_bias = None
    in_proj_weight = None
    _qkv_same_embed_dim = False

    def __init__(self, embed_dim: int, num_heads: int, ranks: "tuple[int, int, int, int]", *, dropout: float = 0.0,
                 bias: bool = True, kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout, self.batch_first = float(dropout), batch_first
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = LowRankLinear(embed_dim, embed_dim, ranks[0], **kw)
        self.k_proj = LowRankLinear(self.kdim, embed_dim, ranks[1], **kw)
        self.v_proj = LowRankLinear(self.vdim, embed_dim, ranks[2], **kw)
        self.out_proj = LowRankLinear(embed_dim, embed_dim, ranks[3], **kw)

    @classmethod
    def from_dense(cls, attention: nn.MultiheadAttention, rank_ratio: float) -> "LowRankMultiheadAttention":
        """The SVD-initialised attention for ``attention``, each projection factorized on its own.

        Args:
            attention: the dense module; not modified.
            rank_ratio: rank over each projection's full rank, in (0, 1].

        Returns:
            A module on ``attention``'s device and in its dtype.

        Raises:
            ValueError: ``bias_k``/``bias_v`` or ``add_zero_attn``.
        """
        if attention.bias_k is not None or attention.add_zero_attn:
            raise ValueError("MultiheadAttention with bias_k/bias_v or add_zero_attn cannot be factorized")
        embed = attention.embed_dim
        if attention._qkv_same_embed_dim:
            weights = attention.in_proj_weight.chunk(3)
        else:
            weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
        in_bias = attention.in_proj_bias
        biases = in_bias.chunk(3) if in_bias is not None else (None, None, None)
        out = attention.out_proj
        projections = [LowRankLinear.from_weight(weight, bias, rank_for(min(weight.shape), rank_ratio))
                       for weight, bias in zip(weights, biases)]
        projections.append(LowRankLinear.from_weight(out.weight, out.bias, rank_for(embed, rank_ratio)))
        module = cls(embed, attention.num_heads, tuple(proj.rank for proj in projections),
                     dropout=attention.dropout, bias=in_bias is not None, kdim=attention.kdim,
                     vdim=attention.vdim, batch_first=attention.batch_first,
                     device=out.weight.device, dtype=out.weight.dtype)
        module.q_proj, module.k_proj, module.v_proj, module.out_proj = projections
        return module

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks of the q, k, v and output projections."""
        return tuple(proj.rank for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward`` (shapes in the class docstring).

        ``attn_mask`` (boolean: True may not attend; float: added) takes precedence over
        ``is_causal``, which builds a causal mask only when no ``attn_mask`` is given.
        """
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # From here on (L, N, E) and (S, N, kdim/vdim).
        target_len, batch = query.shape[:2]
        source_len, heads = key.shape[0], self.num_heads

        def split_heads(x: Tensor) -> Tensor:  # (len, N, E) -> (N, heads, len, head_dim)
            return x.unflatten(-1, (heads, self.head_dim)).permute(1, 2, 0, 3)

        q, k, v = split_heads(self.q_proj(query)), split_heads(self.k_proj(key)), split_heads(self.v_proj(value))
        mask = None
        if attn_mask is not None:
            mask = _additive_mask(attn_mask, q.dtype)
            if mask.dim() == 3:
                mask = mask.view(batch, heads, target_len, source_len)
        elif is_causal:
            causal = torch.ones(target_len, source_len, dtype=torch.bool, device=q.device).triu(1)
            mask = _additive_mask(causal, q.dtype)
        if key_padding_mask is not None:
            padding = _additive_mask(key_padding_mask, q.dtype).view(batch, 1, 1, source_len)
            mask = padding if mask is None else mask + padding
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            weights = (scores if mask is None else scores + mask).softmax(dim=-1)
            if dropout:
                weights = F.dropout(weights, dropout, training=True)
            attended = weights @ v
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        output = self.out_proj(attended.permute(2, 0, 1, 3).flatten(-2))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            return output.squeeze(1), None if weights is None else weights.squeeze(0)
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, ranks={self.ranks}, "
                f"batch_first={self.batch_first}")
