"""``gradwire lowrank summary``: the per-layer report (:func:`gradwire.lowrank.summarize`) of a
shipped model, as a table and optionally JSON::

    gradwire lowrank summary --model resnet18 --rank-ratio 0.25 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

from ..lowrank import summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..harness.models import MODELS

    parser.add_argument("--model", choices=tuple(MODELS), default="resnet18", help="shipped model (default resnet18)")
    parser.add_argument("--rank-ratio", type=float, default=0.25, help="rank / full rank, in (0, 1] (default 0.25)")
    parser.add_argument("--keep-full", nargs="*", default=None, metavar="NAME",
                        help="layer names or patterns kept full-rank (default: the model's hybrid policy)")
    parser.add_argument("--min-params", type=int, default=0, help="keep layers with fewer parameters full-rank")
    parser.add_argument("--extra-bn", action="store_true", help="BatchNorm between the two factors of each conv")
    parser.add_argument("--batch-size", type=int, default=1, help="batch size for the MAC count (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def run(args: argparse.Namespace) -> int:
    from ..harness.models import build_model

    model = build_model(args.model)
    try:
        summary = summarize(model, model.example_input(args.batch_size), rank_ratio=args.rank_ratio,
                            keep_full=args.keep_full, min_params=args.min_params, extra_bn=args.extra_bn)
    except ValueError as error:
        print(f"gradwire lowrank summary: error: {error}", file=sys.stderr)
        return 2
    print(f"{args.model}, rank_ratio={args.rank_ratio}")
    print(summary.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "rank_ratio": args.rank_ratio, **summary.to_dict()}, handle, indent=2)
    return 0
