"""Walk any ``nn.Module`` and replace its dense layers by low-rank pairs (Pufferfish).

Covered layers and their replacements (see :mod:`gradwire.lowrank.layers`):

* ``nn.Conv2d`` (groups=1) -> :class:`LowRankConv2d` (k x k conv to r channels, 1x1 conv back);
* ``nn.Linear`` -> :class:`LowRankLinear`;
* Hugging Face's ``Conv1D`` (GPT-2; a Linear with its weight stored transposed) ->
  :class:`LowRankConv1D` (recognized without importing transformers);
* ``nn.LSTM`` (no proj_size) -> :class:`LowRankLSTM` (all 8 gate matrices per layer factorized);
* ``nn.MultiheadAttention`` (no bias_k/add_zero_attn) -> :class:`LowRankMultiheadAttention`
  (Q, K, V and output projections). A ``nn.TransformerEncoderLayer`` is thereby covered whole:
  its attention through this, its FFN ``linear1``/``linear2`` as plain Linears.

Which layers stay full-rank is decided per layer, in this order: a ``keep_full`` match, fewer
than ``min_params`` parameters, an unsupported configuration, weights shared with another
layer (factorizing would silently untie them), and finally no parameter savings at the rank.
The decisions are stored on the returned model as ``model.lowrank_decisions``.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable

from torch import nn

from ..errors import is_integer, is_real
from .layers import LowRankConv1D, LowRankConv2d, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention

#: Dense layer type -> its low-rank replacement. Checked in order (subclasses match too).
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv2d: LowRankConv2d,
    nn.Linear: LowRankLinear,
    nn.LSTM: LowRankLSTM,
    nn.MultiheadAttention: LowRankMultiheadAttention,
}
LOW_RANK_TYPES = (*REPLACEMENTS.values(), LowRankConv1D)
#: Layer types that hold most of a model's weights but have no low-rank form here, and why.
NOT_FACTORIZED = {
    "Embedding": "a lookup table (factorizing it saves no gradient bytes per looked-up row)",
    "EmbeddingBag": "a lookup table",
    "Conv1d": "no low-rank Conv1d here",
    "Conv3d": "no low-rank Conv3d here",
    "ConvTranspose2d": "no low-rank transposed conv here",
    "GRU": "no low-rank GRU here",
    "RNN": "no low-rank RNN here",
}


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (a Linear with weight (in, out))."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers") \
        and getattr(module, "weight", None) is not None and module.weight.dim() == 2


@dataclass(frozen=True)
class LayerDecision:
    """What :func:`factorize` did with one candidate layer.

    Attributes:
        name: the layer's qualified name ("" for the model itself).
        kind: its class name, e.g. ``"Conv2d"``.
        shape: the shape of the dense layer's first weight (conv: (c_out, c_in, k, k); Linear:
            (out, in); LSTM: weight_ih_l0 (4*hidden, in); attention: in_proj_weight (3E, E)).
        factorized: whether it was replaced.
        ranks: empty for kept layers, else the replacement's ``ranks`` (conv/linear: (r,); LSTM:
            input-hidden rank per layer then the hidden-hidden rank; attention: q, k, v, out).
        params_before: the dense layer's parameters.
        params_after: the replacement's parameters (``params_before`` for a kept layer).
        reason: why a layer was kept ("factorized" otherwise).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    factorized: bool
    ranks: tuple[int, ...]
    params_before: int
    params_after: int
    reason: str


def check_rank_ratio(rank_ratio: float) -> None:
    """Raise ``ValueError`` naming ``rank_ratio`` unless it is a number in (0, 1]."""
    if not is_real(rank_ratio) \
            or not math.isfinite(rank_ratio) or not 0.0 < rank_ratio <= 1.0:
        raise ValueError(f"rank_ratio={rank_ratio!r} must be a number in (0, 1]")


def factorize(model: nn.Module, rank_ratio: float = 0.25, keep_full: "Iterable[str] | str | None" = None,
              min_params: int = 0, *, inplace: bool = False, extra_bn: bool = False,
              require_savings: bool = True) -> nn.Module:
    """Return ``model`` with its dense layers replaced by SVD-initialised low-rank pairs.

    Args:
        model: any module (not a DDP wrapper: pass ``ddp.module``, or use :class:`Warmup`).
        rank_ratio: r = max(1, round(rank_ratio * min(out, in*k*k))) per matrix; in (0, 1].
        keep_full: qualified names (a name keeps the module and everything under it) or
            ``fnmatch`` patterns of layers to leave full-rank. ``None`` uses the model's own
            hybrid policy, ``model.lowrank_keep_full`` (the shipped models follow the paper),
            or else keeps the first and the last candidate layer. ``()`` keeps nothing.
        min_params: layers with fewer parameters stay full-rank.
        inplace: modify ``model`` itself (kept layers keep their Parameter objects) instead of
            a deep copy.
        extra_bn: put a BatchNorm2d between the two factors of every factorized conv.
        require_savings: keep a layer whose factorization would not have fewer parameters.
            Set False to factorize anyway (at ``rank_ratio=1`` the output is then unchanged).

    Returns:
        The factorized model (``model`` itself when ``inplace``), on the same devices and in
        the same dtypes, with ``lowrank_decisions``: one :class:`LayerDecision` per candidate.

    Raises:
        ValueError: a bad ``rank_ratio``/``min_params``, a DDP-wrapped model, an unknown exact
            name in ``keep_full``, or a model in which no layer ends up factorized.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gradwire.lowrank import factorize
        >>> net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Flatten(),
        ...                     nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> small = factorize(net, rank_ratio=0.25)          # keeps the first and last layer
        >>> [d.name for d in small.lowrank_decisions if d.factorized]
        ['3']
        >>> small(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """
    check_options(model, rank_ratio, keep_full, min_params)
    root = model if inplace else copy.deepcopy(model)
    candidates = find_candidates(root)
    patterns = _keep_full_patterns(root, keep_full, candidates)
    shared = _shared_parameter_ids(root)
    decisions = []
    for name, module in candidates:
        params = _count(module)
        reason = _reason_to_keep(name, module, patterns, min_params, shared)
        replacement = None
        if reason is None:
            replacement = _low_rank(module, rank_ratio, extra_bn)
            if require_savings and _count(replacement) >= params:
                reason = f"no parameter savings at rank {_ranks_text(replacement.ranks)}"
                replacement = None
        if replacement is None:
            decisions.append(LayerDecision(name, type(module).__name__, _shape(module), False, (), params, params,
                                           reason))
            continue
        decisions.append(LayerDecision(name, type(module).__name__, _shape(module), True, replacement.ranks,
                                       params, _count(replacement), "factorized"))
        if name:
            root.set_submodule(name, replacement)
        else:
            root = replacement
    if not any(decision.factorized for decision in decisions):
        raise ValueError(_nothing_factorized(root, decisions))
    _disable_nested_tensor(root)
    root.lowrank_decisions = tuple(decisions)
    return root


def check_options(model: nn.Module, rank_ratio: float = 0.25, keep_full: "Iterable[str] | str | None" = None,
                  min_params: int = 0) -> None:
    """Raise the ``ValueError`` :func:`factorize` would raise for these options, cheaply (no SVD).

    Takes :func:`factorize`'s first four arguments.

    Raises:
        ValueError: a bad ``rank_ratio``/``min_params``, a wrapped or candidate-less model, or
            an unknown name in ``keep_full`` (not: a model in which no layer would end up
            factorized, which needs the sizes at rank).
    """
    check_rank_ratio(rank_ratio)
    if not is_integer(min_params) or min_params < 0:
        raise ValueError(f"min_params={min_params!r} must be an integer >= 0")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise ValueError("factorize: pass the wrapped model (ddp.module), or use lowrank.Warmup, which re-wraps it")
    candidates = find_candidates(model)
    if not candidates:
        raise ValueError("factorize: the model has no Conv2d, Linear, HF Conv1D, LSTM or MultiheadAttention layer to "
                         f"factorize{_skipped_types(model, [])}")
    _keep_full_patterns(model, keep_full, candidates)


def find_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every layer :func:`factorize` can replace, in module order.

    Attention and already factorized modules are taken whole: their inner Linears (e.g. the
    attention's ``out_proj``) are not candidates of their own.

    Returns:
        ``(qualified name, module)`` pairs.
    """
    candidates: list[tuple[str, nn.Module]] = []
    inside: str | None = None  # named_modules is depth-first: a module's descendants follow it
    for name, module in model.named_modules():
        if inside is not None and (inside == "" or name.startswith(inside + ".")):
            continue
        inside = None
        if isinstance(module, LOW_RANK_TYPES):
            inside = name
        elif isinstance(module, tuple(REPLACEMENTS)) or is_hf_conv1d(module):
            candidates.append((name, module))
            inside = name
    return candidates


def _keep_full_patterns(root: nn.Module, keep_full: "Iterable[str] | str | None",
                        candidates: list[tuple[str, nn.Module]]) -> list[str]:
    if keep_full is None:
        policy = getattr(root, "lowrank_keep_full", None)
        if policy is None:
            return [candidates[0][0], candidates[-1][0]]
        keep_full = policy
    patterns = [keep_full] if isinstance(keep_full, str) else list(keep_full)
    known = {name for name, _ in root.named_modules()}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"keep_full entries must be layer names or patterns, got {pattern!r}")
        if not any(char in pattern for char in "*?[") and pattern not in known:
            examples = ", ".join(name for name, _ in candidates[:8])
            raise ValueError(f"keep_full: no layer named {pattern!r}; valid names include: {examples}"
                             f"{', ...' if len(candidates) > 8 else ''}")
    return patterns


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)


def _reason_to_keep(name: str, module: nn.Module, patterns: list[str], min_params: int, shared: set[int]) -> str | None:
    for pattern in patterns:
        if _matches(name, pattern):
            return f"keep_full {pattern!r}"
    params = _count(module)
    if params < min_params:
        return f"min_params ({params} < {min_params})"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"grouped conv (groups={module.groups})"
    if isinstance(module, nn.LSTM) and module.proj_size:
        return "LSTM proj_size is not supported"
    if isinstance(module, nn.MultiheadAttention) and (module.bias_k is not None or module.add_zero_attn):
        return "attention bias_k/add_zero_attn is not supported"
    if any(id(parameter) in shared for parameter in module.parameters()):
        return "weights shared with another layer"
    return None


def _low_rank(module: nn.Module, rank_ratio: float, extra_bn: bool) -> nn.Module:
    if is_hf_conv1d(module):
        return LowRankConv1D.from_dense(module, rank_ratio)
    for dense_type, low_rank_type in REPLACEMENTS.items():
        if isinstance(module, dense_type):
            if low_rank_type is LowRankConv2d:
                return LowRankConv2d.from_dense(module, rank_ratio, extra_bn=extra_bn)
            return low_rank_type.from_dense(module, rank_ratio)
    raise TypeError(f"no low-rank replacement for {type(module).__name__}")


def _shared_parameter_ids(root: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, parameter in root.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _disable_nested_tensor(root: nn.Module) -> None:
    # In eval mode with a padding mask, nn.TransformerEncoder may turn its input into a nested
    # tensor, which only PyTorch's fused layers accept; a low-rank attention layer needs the
    # regular path.
    for module in root.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
                isinstance(inner, LowRankMultiheadAttention) for inner in module.modules()):
            module.use_nested_tensor = False


def _count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _shape(module: nn.Module) -> tuple[int, ...]:
    return tuple(next(module.parameters()).shape)


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return "/".join(map(str, ranks))


def _nothing_factorized(root: nn.Module, decisions: list[LayerDecision]) -> str:
    """The error of a model in which no layer was factorized: every kept layer's type and reason
    (grouped), the layer types that are no candidates at all, and only the advice that can help."""
    groups: dict[tuple[str, str], list[str]] = {}
    for decision in decisions:
        reason = decision.reason.split(" (")[0] if decision.reason.startswith("min_params") else decision.reason
        groups.setdefault((decision.kind, reason), []).append(decision.name or "<model>")
    kept = "; ".join(f"{kind} x{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): {reason}"
                     for (kind, reason), names in groups.items())
    advice = []
    reasons = " ".join(d.reason for d in decisions)
    if "keep_full" in reasons:
        advice.append("keep_full=() factorizes every candidate")
    if "min_params" in reasons:
        advice.append("lower min_params")
    if "no parameter savings" in reasons:
        advice.append("lower rank_ratio (or require_savings=False)")
    hint = f"; {', '.join(advice)}" if advice else "; none of these can be factorized by changing the options"
    return f"factorize: no layer was factorized. Kept: {kept}{_skipped_types(root, decisions)}{hint}"


def _skipped_types(root: nn.Module, decisions: list[LayerDecision]) -> str:
    """``; not candidates: Embedding x2 (a lookup table), ...`` for weight-holding layer types
    factorize has no replacement for (empty when there are none)."""
    covered = {d.name for d in decisions}
    counts: dict[str, int] = {}
    for name, module in root.named_modules():
        kind = type(module).__name__
        if kind in NOT_FACTORIZED and name not in covered:
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return ""
    return "; not candidates: " + ", ".join(f"{kind} x{n} ({NOT_FACTORIZED[kind]})" for kind, n in counts.items())
