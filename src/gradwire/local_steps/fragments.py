"""Which parameters sync together: layers, fragments, and when each fragment's turn comes.

A *layer* is the set of parameters one module owns directly (``fc1.weight`` and ``fc1.bias``),
in the order ``named_parameters()`` yields them. With ``fragments=F`` the layers are dealt to F
fragments in turn, as Streaming DiLoCo strides over layers, but balanced by size: each layer goes
to the fragment with the fewest elements so far, ties broken by whose turn it is next. Equal layers
therefore cycle through the fragments exactly as a stride does (a transformer's repeated blocks
land in every fragment), and one large embedding does not make its fragment twice the others
(a plain stride over ByteGPT's 28 layers gives F = 4 fragments of 18%..30% of the elements; this
rule gives 22%..27%). The assignment depends on names and shapes only, so every rank computes the
same one.

Fragment ``f`` syncs at local step ``(f + 1) H / F`` and then every ``H`` steps: every parameter
syncs exactly once per ``H`` local steps, and at most one fragment is on the wire at a time
(:func:`fragment_due`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Layer:
    """The parameters one module owns directly: indices into the model's parameter list."""

    name: str
    indices: tuple[int, ...]
    numel: int


def layers_of(named: list[tuple[str, torch.Tensor]]) -> list[Layer]:
    """Group ``named`` parameters (``named_parameters()`` order) by owning module, first-seen order.

    Args:
        named: ``(name, parameter)`` pairs; the module is the name without its last component.

    Returns:
        One :class:`Layer` per module, in the order its first parameter appears.
    """
    order: dict[str, list[int]] = {}
    for index, (name, _) in enumerate(named):
        order.setdefault(name.rpartition(".")[0], []).append(index)
    return [Layer(module, tuple(indices), sum(named[i][1].numel() for i in indices))
            for module, indices in order.items()]


def assign_fragments(layers: list[Layer], fragments: int) -> list[list[int]]:
    """Deal layers to ``fragments`` fragments, strided and balanced by size (module docstring).

    Args:
        layers: from :func:`layers_of`.
        fragments: F >= 1.

    Returns:
        Per fragment, the ascending parameter indices it holds; every parameter in exactly one.

    Raises:
        ValueError: F < 1, or more fragments than layers (a fragment would be empty).
    """
    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ValueError(f"fragments={fragments!r} must be an integer >= 1")
    if fragments > len(layers):
        raise ValueError(f"fragments={fragments} is more than the model's {len(layers)} layers (modules with "
                         "parameters): a fragment would be empty")
    sizes = [0] * fragments
    members: list[list[int]] = [[] for _ in range(fragments)]
    turn = 0
    for layer in layers:
        # the lightest fragment; among equals, the first at or after ``turn`` (a plain stride for equal layers)
        chosen = min(range(fragments), key=lambda f: (sizes[f], (f - turn) % fragments))
        sizes[chosen] += layer.numel
        members[chosen].extend(layer.indices)
        turn = (chosen + 1) % fragments
    return [sorted(m) for m in members]


def fragment_due(local_step: int, sync_every: int, fragments: int) -> Optional[int]:
    """The fragment whose sync starts after local step ``local_step`` (1-based), or None.

    Args:
        local_step: inner steps since the local phase began (after the warm-up), >= 1.
        sync_every: H, a multiple of ``fragments``.
        fragments: F.

    Returns:
        ``f`` when ``local_step`` is ``(f + 1) H / F`` modulo H, else None.
    """
    interval = sync_every // fragments
    if local_step < 1 or local_step % interval:
        return None
    return (local_step // interval - 1) % fragments
