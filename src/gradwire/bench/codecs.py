"""``gradwire bench codecs``: bits per index and per value, and speed, of every codec.

Sources of sparse gradients:

* ``synthetic``: n = 2**24 (``--numel``) positions, k = density * n chosen uniformly at random,
  values ~ N(0, 1e-3**2);
* ``mnist``: the gradient of the project's small CNN after a few SGD steps on MNIST-5k, top-k by
  magnitude at each density (the real distribution of positions and values);
* ``lstm``: the 3.6M-parameter LSTM language model's gradient (see :mod:`.codec_workloads`),
  top-k of the whole gradient at each density as above, and also the layer-wise top-10%
  table of codec *pairs* (relative volume next to DeepReduce's published figures);
* ``embedding``: an embedding-heavy model's gradient, sent exactly with the ``nonzero``
  sparsifier: bytes per index codec against the non-zero rows' raw size;
* ``curvefit``: ``polyfit``/``dexp`` on k = 2**16 .. 2**22 values against float16;
* ``lossless``: ``ans`` against byte-shuffle + zstd/deflate on float16/bfloat16/float32 values.

For each index codec: bits per index, the information bound log2(C(n, k)) / k, the ratio to
it, bytes vs the COO int32 baseline, encode and decode throughput in GB/s of the dense float32
gradient the sparse one stands for (4 n bytes / seconds, best of ``--repeats``). For each value
codec: bits per value, bytes vs float32, relative L2 error, the same throughputs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from .. import codecs
from ..codecs.base import index_codec_classes, value_codec_classes
from ..tables import format_table
from . import codec_workloads
from .table import progress
from ..cli.main import json_path_error

DEFAULT_DENSITIES = (0.001, 0.01, 0.1)
SOURCES = ("synthetic", "mnist", "lstm", "embedding", "curvefit", "lossless")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire bench codecs``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--numel", type=int, default=1 << 24,
                        help="dense size of the synthetic gradient (default 2**24)")
    parser.add_argument("--densities", default=",".join(map(str, DEFAULT_DENSITIES)), help="comma-separated, in (0, 1]")
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help="comma-separated: " + ", ".join(SOURCES))
    parser.add_argument("--lstm-density", type=float, default=0.1, help="layer-wise density of the LSTM pairs table")
    parser.add_argument("--index-codecs", default="all", help="comma-separated names or 'all'")
    parser.add_argument("--value-codecs", default="all", help="comma-separated names or 'all'")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or this process's CPU time "
                             "(with --threads 1: an idle core's time on a loaded machine)")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")


def information_bound_bits(numel: int, k: int) -> float:
    """log2(C(numel, k)): the fewest bits that can name a k-subset of numel positions."""
    if k <= 0 or k >= numel:
        return 0.0
    return (math.lgamma(numel + 1) - math.lgamma(k + 1) - math.lgamma(numel - k + 1)) / math.log(2)


#: ``--clock cpu`` times with the process's CPU time: on a shared, loaded machine that is close
#: to what an idle core would take (run with ``--threads 1``), where wall time is not.
_CLOCK = {"clock": time.perf_counter}


def _best_time(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = math.inf, None
    clock = _CLOCK["clock"]
    for _ in range(max(1, repeats)):
        start = clock()
        result = run()
        best = min(best, clock() - start)
    return best, result


def synthetic_gradient(numel: int, density: float, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random ``density`` share of ``numel`` positions (ascending int64) and N(0, 1e-3^2) float32 values."""
    generator = np.random.default_rng(seed)
    k = max(1, int(round(density * numel)))
    indices = np.sort(generator.choice(numel, size=k, replace=False)).astype(np.int64)
    values = torch.from_numpy(generator.standard_normal(k).astype(np.float32) * 1e-3)
    return indices, values


def mnist_gradient(steps: int = 3, seed: int = 0) -> torch.Tensor:
    """The flattened gradient of the small CNN after ``steps`` SGD steps on MNIST-5k."""
    from ..harness.data import load
    from ..harness.models import build_model

    torch.manual_seed(seed)
    train, _ = load("mnist5k")
    model = build_model("cnn", num_classes=10, in_channels=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    for step, (images, labels) in enumerate(loader):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        if step + 1 == steps:
            break
        optimizer.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def top_k_of(gradient: torch.Tensor, density: float) -> tuple[np.ndarray, torch.Tensor]:
    """The exact top-k of ``|gradient|`` at ``density``: ascending int64 positions and their values."""
    k = max(1, int(round(density * gradient.numel())))
    indices = torch.sort(torch.topk(gradient.abs(), k, sorted=False).indices).values
    return indices.numpy(), gradient[indices].contiguous()


def measure_index_codec(name: str, indices: np.ndarray, numel: int, repeats: int) -> dict[str, Any]:
    """One table row: bits per index against the bound, and the best of ``repeats`` encode/decode times."""
    codec = codecs.get_index_codec(name)
    k = int(indices.size)
    encode_seconds, encoding = _best_time(lambda: codec.encode(indices, numel), repeats)
    data = memoryview(encoding.data)
    count = int(encoding.positions.size)
    decode_seconds, decoded = _best_time(lambda: codec.decode(data, numel, count), repeats)
    if not np.array_equal(decoded, encoding.positions):
        raise AssertionError(f"{name} did not round-trip")
    bound = information_bound_bits(numel, k)
    bits = 8.0 * len(encoding.data)
    dense_bytes = 4.0 * numel
    row = {
        "codec": name,
        "bits_per_index": bits / k,
        "bound_bits_per_index": bound / k if k else 0.0,
        "ratio_to_bound": bits / bound if bound else math.inf,
        "bytes_vs_coo": len(encoding.data) / (4.0 * k),
        "encode_gbps": dense_bytes / encode_seconds / 1e9,
        "decode_gbps": dense_bytes / decode_seconds / 1e9,
        "encode_ms": encode_seconds * 1e3,
        "decode_ms": decode_seconds * 1e3,
        "lossless": codec.lossless,
    }
    if not codec.lossless:
        row["positions_sent"] = count
        row["false_positives_sent"] = float(encoding.stats.get("false_positives_sent", 0))
    return row


#: Option variants measured beside the defaults (``--value-codecs all``, or naming the label).
VALUE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qsgd-ans max s=4": ("qsgd-ans", {"norm": "max", "levels": 4}),
    "qsgd-ans range s=1 nearest": ("qsgd-ans", {"norm": "range", "levels": 1, "rounding": "nearest"}),
    "zstd level 19": ("zstd", {"level": 19}),
}


def measure_value_codec(name: str, values: torch.Tensor, numel: int, repeats: int) -> dict[str, Any]:
    """One table row: bits per value, relative L2 error, and the best of ``repeats`` encode/decode times."""
    base, options = VALUE_VARIANTS.get(name, (name, {}))
    codec = codecs.get_value_codec(base, **options)
    k = values.numel()
    encode_seconds, data = _best_time(lambda: codec.encode(values), repeats)
    view = memoryview(data)
    decode_seconds, decoded = _best_time(lambda: codec.decode(view, k, values.dtype), repeats)
    error = float(torch.linalg.vector_norm((decoded.double() - values.double())) /
                  torch.linalg.vector_norm(values.double()).clamp_min(1e-300))
    dense_bytes = 4.0 * numel
    return {
        "codec": name,
        "bits_per_value": 8.0 * len(data) / k,
        "bytes_vs_fp32": len(data) / (4.0 * k),
        "relative_l2_error": error,
        "encode_gbps": dense_bytes / encode_seconds / 1e9,
        "decode_gbps": dense_bytes / decode_seconds / 1e9,
        "encode_ms": encode_seconds * 1e3,
        "decode_ms": decode_seconds * 1e3,
        "lossless": codec.lossless,
    }


def _names(option: str, available: list[str], what: str) -> list[str]:
    if option == "all":
        return available
    names = [n.strip() for n in option.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise ValueError(f"--{what}={option!r}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"allowed: 'all' or a comma-separated list of {', '.join(available)}")
    return names


def _densities(option: str) -> list[float]:
    try:
        densities = [float(d) for d in option.split(",")]
    except ValueError:
        densities = []
    if not densities or any(not 0 < d <= 1 for d in densities):  # NaN fails the range test too
        raise ValueError(f"--densities={option!r} is not supported; allowed: comma-separated numbers in (0, 1]")
    return densities


def check_arguments(args: argparse.Namespace) -> tuple[list[float], list[str], list[str], list[str]]:
    """(densities, sources, index codec names, value codec names) of ``args``.

    Raises:
        ValueError: an option out of range or naming something unknown; the message names the
            option and what it allows, and is printed as one line (exit status 2).
    """
    if args.numel < 1:
        raise ValueError(f"--numel={args.numel} is not supported; allowed: an integer >= 1")
    for option, value, low in (("--repeats", args.repeats, 1), ("--threads", args.threads, 0)):
        if value < low:
            raise ValueError(f"{option}={value} is not supported; allowed: an integer >= {low}")
    densities = _densities(args.densities)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise ValueError(f"--sources={args.sources!r}: unknown {', '.join(bad) or '(none given)'}; "
                         f"allowed: a comma-separated list of {', '.join(SOURCES)}")
    if not 0 < args.lstm_density <= 1:
        raise ValueError(f"--lstm-density={args.lstm_density} is not supported; allowed: a number in (0, 1]")
    index_names = _names(args.index_codecs, sorted(index_codec_classes()), "index-codecs")
    value_names = _names(args.value_codecs, sorted(value_codec_classes()) + list(VALUE_VARIANTS), "value-codecs")
    return densities, sources, index_names, value_names


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench codecs``: measure and print the tables; returns 0, or 2 on a bad option."""
    problem = json_path_error(args.json)
    if problem is not None:
        print(f"gradwire bench codecs: {problem}", file=sys.stderr)
        return 2
    try:
        densities, sources, index_names, value_names = check_arguments(args)
    except ValueError as error:  # a bad option is the user's to fix: one line, not a traceback
        print(f"gradwire bench codecs: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    _CLOCK["clock"] = time.process_time if args.clock == "cpu" else time.perf_counter
    gradients = {}
    if "mnist" in sources:
        gradients["mnist"] = mnist_gradient()
    lstm_parts = None
    if "lstm" in sources:
        lstm_parts = codec_workloads.lstm_gradient()
        gradients["lstm"] = torch.cat([g.reshape(-1) for _, g in lstm_parts])

    cases = []
    for source in sources:
        if source in ("embedding", "curvefit", "lossless"):
            continue
        for density in densities:
            cases.append((source, density))
    rows: list[dict[str, Any]] = []
    total = len(cases) * (len(index_names) + len(value_names))
    with progress(total, "bench codecs") as bar:
        for source, density in cases:
            if source == "synthetic":
                numel = args.numel
                indices, values = synthetic_gradient(numel, density)
            else:
                numel = gradients[source].numel()
                indices, values = top_k_of(gradients[source], density)
            common = {"source": source, "numel": numel, "density": density, "k": int(indices.size)}
            for name in index_names:
                bar.set_postfix_str(f"{source} {density} index {name}")
                rows.append({"kind": "index", **common, **measure_index_codec(name, indices, numel, args.repeats)})
                bar.update()
            for name in value_names:
                bar.set_postfix_str(f"{source} {density} values {name}")
                rows.append({"kind": "value", **common, **measure_value_codec(name, values, numel, args.repeats)})
                bar.update()

    print_tables(rows)
    extra: dict[str, Any] = {}
    if lstm_parts is not None:
        extra["lstm_pairs"] = codec_workloads.lstm_rows(lstm_parts, args.lstm_density)
        print_lstm_pairs(extra["lstm_pairs"], args.lstm_density, sum(g.numel() for _, g in lstm_parts))
    if "embedding" in sources:
        embedding = codec_workloads.embedding_gradient()
        extra["embedding"], extra["embedding_info"] = codec_workloads.embedding_rows(embedding)
        print_embedding(extra["embedding"], extra["embedding_info"])
    if "curvefit" in sources:
        extra["curvefit"] = codec_workloads.curvefit_rows()
        print_curvefit(extra["curvefit"])
    if "lossless" in sources:
        extra["lossless"] = codec_workloads.lossless_rows(repeats=args.repeats)
        print_lossless(extra["lossless"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch_threads": torch.get_num_threads(), "rows": rows, **extra}, handle, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def print_tables(rows: list[dict[str, Any]], out: Any = None) -> None:
    """Print the index and value tables of every (source, density), to ``out`` (default stdout)."""
    out = out if out is not None else sys.stdout  # read at call time: tests swap sys.stdout
    for (source, density), group in _grouped(rows).items():
        first = group[0]
        print(f"\n{source}: numel={first['numel']:,} density={density:g} k={first['k']:,}", file=out)
        index_rows = [r for r in group if r["kind"] == "index"]
        value_rows = [r for r in group if r["kind"] == "value"]
        if index_rows:
            print(format_table(
                ["index codec", "bits/index", "bound", "x bound", "vs COO", "enc GB/s", "dec GB/s", "note"],
                [[r["codec"], f"{r['bits_per_index']:.2f}", f"{r['bound_bits_per_index']:.2f}",
                  f"{r['ratio_to_bound']:.3f}", f"{r['bytes_vs_coo']:.3f}", f"{r['encode_gbps']:.2f}",
                  f"{r['decode_gbps']:.2f}",
                  "" if r["lossless"] else f"lossy: {int(r.get('false_positives_sent', 0)):,} FP sent"]
                 for r in index_rows]), file=out)
        if value_rows:
            print(format_table(
                ["value codec", "bits/value", "vs fp32", "rel L2 err", "enc GB/s", "dec GB/s"],
                [[r["codec"], f"{r['bits_per_value']:.2f}", f"{r['bytes_vs_fp32']:.3f}",
                  f"{r['relative_l2_error']:.2e}", f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}"]
                 for r in value_rows]), file=out)


def print_lstm_pairs(rows: list[dict[str, Any]], density: float, numel: int, out: Any = None) -> None:
    """Print the LSTM codec-pair table beside DeepReduce's figures."""
    out = out if out is not None else sys.stdout  # read at call time: tests swap sys.stdout
    print(f"\nlstm LM ({numel:,} parameters), top-{100 * density:g}% layer-wise, one payload per parameter: "
          "relative volume = bytes / dense fp32", file=out)
    print(format_table(
        ["index + values", "bytes", "relative volume", "rel L2 err of sent values", "DeepReduce (paper, its LSTM)"],
        [[r["pair"], f"{r['bytes']:,}", f"{r['relative_volume']:.4f}", f"{r['relative_l2_error']:.3g}",
          r["deepreduce"]] for r in rows]), file=out)


def print_embedding(rows: list[dict[str, Any]], info: dict[str, int], out: Any = None) -> None:
    """Print the embedding-heavy model's index codec table."""
    out = out if out is not None else sys.stdout  # read at call time: tests swap sys.stdout
    print(f"\nembedding-heavy model, nonzero sparsifier + fp32 values: {info['nonzeros']:,} non-zeros, "
          f"non-zero rows raw {info['nonzero_row_bytes']:,} B, dense {info['dense_bytes']:,} B", file=out)
    print(format_table(
        ["index codec", "bytes (per layer)", "x rows raw", "bytes (joined)", "x rows raw", "bit-exact"],
        [[r["index_codec"], f"{r['layerwise_bytes']:,}", f"{r['layerwise_vs_rows']:.4f}", f"{r['joined_bytes']:,}",
          f"{r['joined_vs_rows']:.4f}", "yes" if r["exact"] else "NO"] for r in rows]), file=out)


def print_curvefit(rows: list[dict[str, Any]], out: Any = None) -> None:
    """Print the large-k curve-fit table."""
    out = out if out is not None else sys.stdout
    print("\ncurve fits at large k, tolerance 0.05 (stated bound: max error <= 0.05 max|v|), N(0, 1e-3^2) values; "
          "layout 0 plain, 1 fitted, 2 levels", file=out)
    print(format_table(
        ["k", "codec", "bits/value", "max err / max|v|", "layout", "enc s", "dec s"],
        [[f"2^{r['k'].bit_length() - 1}", r["codec"], f"{r['bits_per_value']:.3f}", f"{r['max_error_vs_peak']:.4f}",
          "" if r["layout"] < 0 else str(r["layout"]), f"{r['encode_s']:.2f}", f"{r['decode_s']:.2f}"]
         for r in rows]), file=out)


def print_lossless(rows: list[dict[str, Any]], out: Any = None) -> None:
    """Print the lossless value codec table."""
    out = out if out is not None else sys.stdout
    print("\nlossless value codecs, k = 167,772 values (GB/s of the dense gradient at 1% density)", file=out)
    print(format_table(
        ["values", "dtype", "codec", "bits/value", "enc GB/s", "dec GB/s"],
        [[r["data"], r["dtype"], r["codec"], f"{r['bits_per_value']:.3f}", f"{r['encode_gbps']:.2f}",
          f"{r['decode_gbps']:.2f}"] for r in rows]), file=out)


def _grouped(rows: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["source"], row["density"]), []).append(row)
    return groups
