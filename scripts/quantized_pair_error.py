"""How far two ranks' quantized AllReduce lands from the exact sum, on real gradients: the swap
(each rank quantizes its whole gradient once; both add the two decodings) against the two rounds
it replaced at p = 2 (a quantized reduce-scatter, then the owners' sums re-quantized and gathered).

    python scripts/quantized_pair_error.py [--model mlp] [--block 128] [--pairs 4]

Two gradients of ``--model`` on different synthetic batches (``--pairs`` such pairs), one
process, no collective: both algorithms are replayed with the exchange's own quantizer
(:func:`gradwire.exchange.blockquant.roundtrip`). Prints, per bits, the relative L2 error of the
applied sum ``||applied - exact|| / ||exact||``, median over the pairs.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from gradwire.exchange.blockquant import roundtrip
from gradwire.harness.models import build_model


def _gradients(model_name: str, count: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(model_name)
    flats = []
    for _ in range(count):
        model.zero_grad(set_to_none=True)
        output = model(model.example_input(8))
        output = output[0] if isinstance(output, tuple) else output
        (output.float() ** 2).mean().backward()
        flats.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                for p in model.parameters()]))
    return flats


def _two_rounds(x0: torch.Tensor, x1: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The reduce-scatter and the re-quantized AllGather of two ranks."""
    n = x0.numel()
    chunk = math.ceil(n / 2)
    locals_ = [roundtrip(torch.nn.functional.pad(x, (0, 2 * chunk - n)).reshape(2, chunk), bits=bits,
                         block_size=block)[1] for x in (x0, x1)]
    sums = locals_[0] + locals_[1]
    return roundtrip(sums, bits=bits, block_size=block)[1].reshape(-1)[:n]


def _swap(x0: torch.Tensor, x1: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    return roundtrip(x0, bits=bits, block_size=block)[1] + roundtrip(x1, bits=bits, block_size=block)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    flats = _gradients(args.model, 2 * args.pairs)
    print(f"{args.model}: {flats[0].numel():,} values, blocks of {args.block}, {args.pairs} pairs of gradients")
    print("bits  two rounds (reduce-scatter + re-quantized AllGather)  swap (p = 2)  swap / two rounds")
    for bits in (8, 4):
        errors: dict[str, list[float]] = {"two": [], "swap": []}
        for pair in range(args.pairs):
            x0, x1 = flats[2 * pair], flats[2 * pair + 1]
            exact = x0.double() + x1.double()
            for name, method in (("two", _two_rounds), ("swap", _swap)):
                applied = method(x0, x1, bits, args.block).double()
                errors[name].append(float((applied - exact).norm() / exact.norm()))
        two, swap = statistics.median(errors["two"]), statistics.median(errors["swap"])
        print(f"{bits:>4}  {two:>52.3e}  {swap:>12.3e}  {swap / two:>17.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
