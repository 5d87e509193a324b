"""Compact method specs for the CLI: ``name[:key=value,...]``, joined by ``+`` to combine.

Examples::

    allreduce                                   plain DDP
    torch-fp16                                  PyTorch's fp16_compress_hook
    torch-powersgd:rank=4                       PyTorch's powerSGD_hook
    topk:density=0.01,values=fp16,indices=rice  gradwire hook
    randomblock:density=0.01                    gradwire hook, shared support -> AllReduce
    quantize:bits=4,block=128                   gradwire hook, dense AllReduce of int4 blocks
    pufferfish:rank_ratio=0.25,warmup_epochs=1  low-rank model after a full-rank warm-up
    pufferfish:rank_ratio=0.25+topk:density=0.01
    diloco:sync_every=16,warmup_steps=300       DiLoCo: local steps, a dense outer step every 16
    diloco:sync_every=32+topk:density=0.03,values=qsgd-ans   ... whose outer step sends top-k 3%
    diloco:sync_every=32+quantize:bits=4        ... or int4 blocks

Parsing gives plain data (:class:`MethodSpec`); applying it to a model lives in ``training.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TORCH_HOOKS = ("allreduce", "torch-fp16", "torch-powersgd")

#: gradwire compressor options accepted in a spec -> CommHookState keyword.
HOOK_KEYS = {
    "density": ("density", float),
    "k": ("k", int),
    "threshold": ("threshold", float),
    "values": ("value_codec", str),
    "indices": ("index_codec", str),
    "collective": ("collective", str),
    "scope": ("scope", str),
    "ef": ("error_feedback", "bool"),
    "ef_decay": ("feedback_decay", float),
    "gather": ("all_gather", str),
    "defer": ("defer", "bool"),
    "momentum": ("momentum", float),
    "momentum_correction": ("momentum_correction", float),
    "warmup_steps": ("warmup_steps", int),
    "residuals": ("residual_dtype", str),
    "seed": ("seed", int),
    "chunk": ("chunk", int),
    "hierarchy": ("hierarchy", "hierarchy"),
    "link_gbit": ("link_gbit", float),
    "bits": ("codec_option:bits", int),
    "bucket_size": ("codec_option:bucket_size", int),
    "fpr": ("codec_option:fpr", float),
    "policy": ("codec_option:policy", str),
    "tolerance": ("codec_option:tolerance", float),
    "level": ("codec_option:level", int),
    "levels": ("codec_option:levels", int),
    "norm": ("codec_option:norm", str),
    "rounding": ("codec_option:rounding", str),
}
TORCH_KEYS = {"torch-powersgd": {"rank": int, "start_iter": int}, "torch-fp16": {}, "allreduce": {}}
#: ``quantize:bits=8,block=128``: gradwire's dense AllReduce of int8/int4 blocks (error feedback on)
QUANTIZE_KEYS = {"bits": int, "block": int, "ef": "bool", "ef_decay": float, "warmup_steps": int, "residuals": str,
                 "gather": str, "defer": "bool"}
PUFFERFISH_KEYS = {"rank_ratio": float, "warmup_epochs": int, "carry_momentum": "bool", "extra_bn": "bool"}
#: ``diloco:sync_every=16,...``: local steps; a communication part joined by ``+`` compresses the outer step
DILOCO_KEYS = {"sync_every": int, "outer_lr": float, "outer_momentum": float, "nesterov": "bool",
               "warmup_steps": int, "fragments": int, "overlap": int, "decay": float, "merge_alpha": float,
               "unsent": "unsent", "inner": "inner", "warmup_quantize": "warmup_quantize",
               "warmup_exact": int, "merge": "merge"}
#: spec keys of ``diloco`` whose DiLoCo keyword differs
_DILOCO_NAMES = {"overlap": "overlap_steps", "decay": "feedback_decay", "warmup_exact": "warmup_exact_steps",
                 "merge": "overlap_merge"}


@dataclass(frozen=True)
class Part:
    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method: at most one communication part, one pufferfish part and one ``diloco`` part
    (``local_steps``; the communication part then compresses its outer step)."""

    text: str
    communication: Part
    pufferfish: Part | None = None
    local_steps: Part | None = None

    @property
    def label(self) -> str:
        return self.text

    def diloco_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`gradwire.DiLoCo` (without model, optimizer and group): the
        ``diloco`` part's, and the outer exchange's from the communication part (``allreduce``: dense)."""
        assert self.local_steps is not None
        options = {_DILOCO_NAMES.get(key, key): value for key, value in self.local_steps.options.items()}
        if self.communication.name != "allreduce":
            options.update(self.hook_options())
        return options

    def hook_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`gradwire.CommHookState` (gradwire compressors only)."""
        if self.communication.name == "quantize":
            chosen = self.communication.options
            options = {"compressor": "none", "quantize": f"int{chosen.get('bits', 8)}",
                       "quantize_block": chosen.get("block", 128), "error_feedback": chosen.get("ef", True)}
            if "warmup_steps" in chosen:
                options["warmup_steps"] = chosen["warmup_steps"]
            if "residuals" in chosen:
                options["residual_dtype"] = chosen["residuals"]
            if "ef_decay" in chosen:
                options["feedback_decay"] = chosen["ef_decay"]
            if "gather" in chosen:  # FSDP2 only: the parameter all-gathers too (gradwire.fsdp.compress)
                options["all_gather"] = chosen["gather"]
            if "defer" in chosen:  # FSDP2 only (gradwire.fsdp.compress)
                options["defer"] = chosen["defer"]
            return options
        options: dict[str, Any] = {"compressor": self.communication.name}
        codec_options: dict[str, Any] = {}
        for key, value in self.communication.options.items():
            target = HOOK_KEYS[key][0]
            if target.startswith("codec_option:"):
                codec_options[target.split(":", 1)[1]] = value
            else:
                options[target] = value
        if codec_options:
            options["codec_options"] = codec_options
        return options


def _kind_name(kind: Any) -> str:
    return {"bool": "true/false", "hierarchy": "'auto' or number of ranks per node",
            "unsent": "residual|model", "inner": "none|ddp (DDP inside each node)",
            "warmup_quantize": "int8|int4", "merge": "mix|carry"}.get(kind, getattr(kind, "__name__", str(kind)))


def spec_help(width: int = 100) -> str:
    """What a method spec may say, for ``gradwire train --help``: every name and every key with its
    type (and its choices where the library has a fixed set), read from the tables above and the
    registries, so the help cannot drift from what :func:`parse_method` accepts.

    Args:
        width: the line width to wrap at.

    Returns:
        Plain text, one paragraph per kind of method.
    """
    import textwrap

    from ..codecs import base as codec_base  # the package registers every codec on import
    from ..core.config import SCOPES
    from ..exchange.cost import COLLECTIVES
    from ..sparsify import sparsifiers

    choices = {"values": sorted(codec_base.value_codec_classes()), "indices": sorted(codec_base.index_codec_classes()),
               "collective": list(COLLECTIVES), "scope": list(SCOPES)}

    def keys(table: dict[str, Any]) -> str:
        described = []
        for key, kind in table.items():
            allowed = choices.get(key)
            described.append(f"{key}={'|'.join(allowed) if allowed else _kind_name(kind)}")
        return ", ".join(described) or "(no keys)"

    def paragraph(head: str, body: str) -> str:
        return textwrap.fill(f"{head}: {body}", width, initial_indent="  ", subsequent_indent="      ",
                             break_on_hyphens=False)

    hook_keys = {key: kind for key, (_, kind) in HOOK_KEYS.items()}
    lines = ["method specs (--method SPEC): NAME[:KEY=VALUE,...]; '+' joins pufferfish with one communication "
             "method", *(paragraph(name, keys(TORCH_KEYS[name])) for name in TORCH_HOOKS),
             paragraph(f"gradwire compressors ({', '.join(sparsifiers())})", keys(hook_keys)),
             paragraph("quantize (dense AllReduce of int8/int4 blocks, bits=8|4, error feedback)",
                       keys(QUANTIZE_KEYS)),
             paragraph("pufferfish (low-rank model after a full-rank warm-up)", keys(PUFFERFISH_KEYS)),
             paragraph("diloco (local steps, an outer step every sync_every; '+' a compressor or quantize part "
                       "compresses it: docs/local-steps.md)", keys(DILOCO_KEYS))]
    return "\n".join(lines)


def _convert(spec: str, key: str, raw: str, kind: Any) -> Any:
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if kind == "hierarchy":  # ranks per node, or "auto" (torchrun's LOCAL_WORLD_SIZE)
            return raw if raw == "auto" else int(raw)
        if kind in ("unsent", "inner", "warmup_quantize", "merge"):
            if raw not in {"unsent": ("residual", "model"), "inner": ("none", "ddp"),
                           "warmup_quantize": ("int8", "int4"), "merge": ("mix", "carry")}[kind]:
                raise ValueError(raw)
            return raw
        return kind(raw)
    except ValueError:
        raise ValueError(f"method {spec!r}: {key}={raw!r} is not a valid {_kind_name(kind)}") from None


def _parse_part(spec: str, text: str, compressors: list[str]) -> Part:
    name, _, rest = text.partition(":")
    name = name.strip()
    allowed_names = [*TORCH_HOOKS, "pufferfish", "diloco", "quantize", *compressors]
    if name not in allowed_names:
        raise ValueError(f"method {spec!r}: {name!r} is not supported; allowed: {', '.join(allowed_names)}")
    if name == "pufferfish":
        keys: dict[str, Any] = PUFFERFISH_KEYS
    elif name == "diloco":
        keys = DILOCO_KEYS
    elif name in TORCH_HOOKS:
        keys = TORCH_KEYS[name]
    elif name == "quantize":
        keys = QUANTIZE_KEYS
    else:
        keys = {key: kind for key, (_, kind) in HOOK_KEYS.items()}
    options: dict[str, Any] = {}
    for item in filter(None, (piece.strip() for piece in rest.split(","))):
        key, equals, raw = item.partition("=")
        key = key.strip()
        if not equals:
            raise ValueError(f"method {spec!r}: {item!r} must be key=value")
        if key not in keys:
            raise ValueError(f"method {spec!r}: {name} has no option {key!r}; allowed: {', '.join(keys) or '(none)'}")
        options[key] = _convert(spec, key, raw.strip(), keys[key])
    return Part(name, options)


def parse_method(spec: str) -> MethodSpec:
    """Parse one method spec; ValueError names the bad part and lists what is allowed."""
    from ..sparsify import sparsifiers

    if not spec or not spec.strip():
        raise ValueError("method spec is empty; e.g. 'allreduce' or 'topk:density=0.01'")
    parts = [_parse_part(spec, piece, sparsifiers()) for piece in spec.split("+")]
    pufferfish = [p for p in parts if p.name == "pufferfish"]
    local_steps = [p for p in parts if p.name == "diloco"]
    communication = [p for p in parts if p.name not in ("pufferfish", "diloco")]
    if len(pufferfish) > 1 or len(communication) > 1 or len(local_steps) > 1:
        raise ValueError(f"method {spec!r}: combine at most one pufferfish part, one diloco part and one "
                         "communication method")
    if local_steps:
        if "sync_every" not in local_steps[0].options:
            raise ValueError(f"method {spec!r}: diloco needs sync_every=N (inner steps between outer steps)")
        if communication and communication[0].name in ("torch-fp16", "torch-powersgd"):
            raise ValueError(f"method {spec!r}: diloco's outer step takes a gradwire compressor or quantize part, "
                             f"not {communication[0].name!r}")
        if communication and "warmup_steps" in communication[0].options:
            raise ValueError(f"method {spec!r}: with diloco, warmup_steps belongs to the diloco part (synchronous "
                             "steps before the first local period)")
    return MethodSpec(spec.strip(), communication[0] if communication else Part("allreduce"),
                      pufferfish[0] if pufferfish else None, local_steps[0] if local_steps else None)
