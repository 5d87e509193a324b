"""Per-layer report of a factorization: ranks, parameters and multiply-adds before and after.

Multiply-adds (MACs) are counted for one forward pass of a given input by forward hooks on
the weight layers, from module shapes: conv ``out.numel() * c_in/groups * k * k``, Linear
``rows * in * out``, LSTM ``T * N * 4 * hidden * (in + hidden)`` per layer and direction (the
low-rank LSTM's factors likewise), attention its four projections plus ``2 * N * L * S * E``
for the score and value products. Normalization, activations and pooling are not counted.

The ``gradwire lowrank summary`` command that prints it for a shipped model is
:mod:`gradwire.cli.lowrank_summary` (the models belong to the harness, above this package).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..tables import format_table
from .factorize import LayerDecision, factorize
from .layers import LowRankLSTM, LowRankMultiheadAttention


@dataclass(frozen=True)
class LayerRow:
    """One candidate layer of a :class:`Summary`.

    Attributes:
        decision: what :func:`~gradwire.lowrank.factorize` did with it.
        macs_before: multiply-adds of the dense layer per forward pass of the example input.
        macs_after: the same for its replacement (or the kept layer).
    """

    decision: LayerDecision
    macs_before: int
    macs_after: int


@dataclass(frozen=True)
class Summary:
    """Rows for every candidate layer, and whole-model parameter counts.

    Attributes:
        rows: one per candidate layer, in module order.
        model_params_before: all parameters of the full-rank model (normalization layers and
            embeddings included; shared ones counted once).
        model_params_after: the same for the factorized model.
        input_shape: the example input's shape the MACs were counted for.
    """

    rows: tuple[LayerRow, ...]
    model_params_before: int
    model_params_after: int
    input_shape: tuple[int, ...]

    @property
    def macs_before(self) -> int:
        """Multiply-adds of the candidate layers, full-rank."""
        return sum(row.macs_before for row in self.rows)

    @property
    def macs_after(self) -> int:
        """Multiply-adds of the candidate layers, factorized."""
        return sum(row.macs_after for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serializable: every row's decision and MACs, and the totals."""
        layers = [{**asdict(row.decision), "macs_before": row.macs_before, "macs_after": row.macs_after}
                  for row in self.rows]
        return {"input_shape": list(self.input_shape), "layers": layers,
                "model_params_before": self.model_params_before, "model_params_after": self.model_params_after,
                "macs_before": self.macs_before, "macs_after": self.macs_after}

    def table(self) -> str:
        """A plain-text table, one line per layer, then totals."""
        headers = ("layer", "kind", "shape", "rank", "params", "params lr", "MACs", "MACs lr", "decision")
        lines = []
        for row in self.rows:
            d = row.decision
            lines.append((d.name or "<model>", d.kind, "x".join(map(str, d.shape)),
                          "/".join(map(str, d.ranks)) or "full", f"{d.params_before:,}", f"{d.params_after:,}",
                          f"{row.macs_before:,}", f"{row.macs_after:,}", d.reason))
        lines.append(("total (these layers)", "", "", "", f"{sum(r.decision.params_before for r in self.rows):,}",
                      f"{sum(r.decision.params_after for r in self.rows):,}", f"{self.macs_before:,}",
                      f"{self.macs_after:,}", ""))
        ratio = self.model_params_after / self.model_params_before
        macs_ratio = self.macs_after / self.macs_before if self.macs_before else float("nan")
        return (format_table(headers, lines) + f"\nmodel parameters: {self.model_params_before:,} -> "
                f"{self.model_params_after:,} ({ratio:.3f}x); MACs per forward of {tuple(self.input_shape)}: "
                f"{macs_ratio:.3f}x")


def summarize(model: nn.Module, example_input: Tensor, factorized: nn.Module | None = None,
              **factorize_kwargs: Any) -> Summary:
    """Report on a factorized model against the full-rank ``model``.

    Args:
        model: the full-rank model; not modified.
        example_input: one batch to count MACs for (e.g. ``model.example_input(1)`` of a shipped
            model), on the models' device.
        factorized: the factorized model (default: ``factorize(model, **factorize_kwargs)``, a
            copy).
        **factorize_kwargs: options of :func:`~gradwire.lowrank.factorize`, when it runs here.

    Returns:
        The :class:`Summary`.

    Raises:
        ValueError: ``factorized`` carries no ``lowrank_decisions``, or what ``factorize`` raises.
    """
    if factorized is None:
        factorized = factorize(model, inplace=False, **factorize_kwargs)
    decisions: tuple[LayerDecision, ...] = getattr(factorized, "lowrank_decisions", ())
    if not decisions:
        raise ValueError("summarize: `factorized` carries no lowrank_decisions; build it with lowrank.factorize")
    names = [decision.name for decision in decisions]
    before, after = count_macs(model, example_input, names), count_macs(factorized, example_input, names)
    rows = tuple(LayerRow(d, before.get(d.name, 0), after.get(d.name, 0)) for d in decisions)
    return Summary(rows, _count(model), _count(factorized), tuple(example_input.shape))


def count_macs(model: nn.Module, example_input: Tensor, layer_names: Sequence[str]) -> dict[str, int]:
    """MACs of one forward pass of ``example_input``, summed per name in ``layer_names``.

    Args:
        model: the model to run (in eval mode, under ``torch.no_grad``; its mode is restored).
        example_input: one batch.
        layer_names: qualified names; a weight layer counts towards the longest listed name
            that is it or contains it.

    Returns:
        MACs by listed name (names with none are absent).
    """
    totals: dict[str, int] = {}
    handles = []

    def owner(name: str) -> str | None:
        matches = [n for n in layer_names if n == name or not n or name.startswith(n + ".")]
        return max(matches, key=len) if matches else None

    for name, module in model.named_modules():
        layer = owner(name)
        if layer is not None and isinstance(module, _COUNTED):
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any, layer: str = layer) -> None:
                totals[layer] = totals.get(layer, 0) + _macs(module, args, kwargs, output)
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return totals


_COUNTED = (nn.Conv2d, nn.Linear, nn.LSTM, LowRankLSTM, nn.MultiheadAttention, LowRankMultiheadAttention)


def _macs(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> int:
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return output.numel() * module.in_channels // module.groups * kh * kw
    if isinstance(module, nn.Linear):
        return output.numel() * module.in_features
    if isinstance(module, (nn.LSTM, LowRankLSTM)):
        return _lstm_macs(module, args[0].numel() // module.input_size)
    query = args[0] if args else kwargs["query"]
    key = args[1] if len(args) > 1 else kwargs["key"]
    embed = module.embed_dim
    batch = 1 if query.dim() == 2 else query.shape[0 if module.batch_first else 1]
    queries, keys = query.numel() // embed, key.numel() // module.kdim  # (L*N, S*N)
    attention = 2 * queries * (keys // batch) * embed
    if isinstance(module, LowRankMultiheadAttention):
        return attention  # its projections are Linear modules, counted by their own hooks
    return attention + 2 * queries * embed * embed + keys * embed * (module.kdim + module.vdim)


def _lstm_macs(lstm: nn.Module, steps: int) -> int:
    hidden, directions = lstm.hidden_size, 2 if lstm.bidirectional else 1
    total = 0
    for layer in range(lstm.num_layers):
        layer_input = lstm.input_size if layer == 0 else hidden * directions
        if isinstance(lstm, LowRankLSTM):
            r_ih, r_hh = lstm.ranks_ih[layer], lstm.rank_hh
            per_step = 4 * r_ih * (layer_input + hidden) + 4 * r_hh * (hidden + hidden)
        else:
            per_step = 4 * hidden * (layer_input + hidden)
        total += directions * steps * per_step
    return total


def _count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
