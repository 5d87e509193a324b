"""One prepared check of the CUDA paths, for a machine with one GPU (at most ~5 minutes).

    python scripts/gpu_check.py [--json PATH] [--budget 280]
    python scripts/gpu_check.py --device cpu --small      # the same checks on the CPU, small (CI)

No accelerator is lent where gradwire is developed, so this runs unattended where one is:

1. **The hot path on CUDA tensors**, for gradients shaped like ResNet-50 (25.6M elements in 161
   tensors) and like a 1B-parameter transformer: ms per step by phase (check, compensate, select,
   encode, decode, agree; each phase synchronized), next to a one-pass CUDA floor
   (``torch.add(a, b, out=c)`` over the same numel), for top-k 1% fp16/Rice (AllGather and sparse
   AllReduce), randomblock 1% fp16, the int8 quantized AllReduce and dense. A one-rank NCCL
   group: what is timed is the hook's own device work and host syncs. Also the number of host
   syncs per step is reported (``torch.cuda`` synchronizations are counted by a hook on
   ``Tensor.item``/``tolist``, a lower bound).
2. **The codecs on CUDA tensors**: encode + decode of a top-k 1% selection of 16M values for each
   index codec x {fp16, fp32} (they run on the host: what a CUDA caller pays is measured).
3. **Two ranks on one GPU**, what one GPU allows: DDP with gloo and CUDA tensors (NCCL refuses two
   ranks on one device), for each collective; a collective gloo cannot run on CUDA tensors is
   reported as such, not as a failure of gradwire.

Each section has its share of ``--budget`` seconds and is skipped, saying so, when time runs out.
Prints one table per section and writes every number to ``--json`` (default ``$OUT/gpu_check.json``
when ``$OUT`` is set). Exit status 0 unless a check that should pass failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gradwire.core.config import ExchangeConfig  # noqa: E402
from gradwire.core.group import BufferTarget, Entry, Group  # noqa: E402
from gradwire.core.pipeline import Pipeline  # noqa: E402
from gradwire.tables import format_table  # noqa: E402

PHASES = ("check", "compensate", "select", "encode", "decode", "agree")
METHODS = {
    "topk 1% fp16/rice allgather": {"compressor": "topk", "density": 0.01, "value_codec": "fp16",
                                    "index_codec": "rice", "collective": "allgather"},
    "topk 1% fp16/rice sparse-allreduce": {"compressor": "topk", "density": 0.01, "value_codec": "fp16",
                                           "index_codec": "rice", "collective": "sparse-allreduce"},
    "randomblock 1% fp16": {"compressor": "randomblock", "density": 0.01, "value_codec": "fp16",
                            "collective": "allreduce"},
    "int8 quantized": {"compressor": "none", "quantize": "int8"},
    "dense": {"compressor": "none"},
}


def resnet50_shapes() -> list[int]:
    """Parameter sizes of ResNet-50 (torchvision layout, 25,557,032 in 161 tensors)."""
    sizes = [64 * 3 * 49, 64, 64]
    in_channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out = width * 4
            sizes += [width * in_channels, width, width, width * width * 9, width, width, out * width, out, out]
            if block == 0:
                sizes += [out * in_channels, out, out]
            in_channels = out
    return sizes + [1000 * 2048, 1000]


def transformer_1b_shapes(layers: int = 18, d: int = 2048, vocab: int = 50_304) -> list[int]:
    """A 1B decoder (1,009,143,808 elements): embedding, per layer attention (4 d^2) + MLP (8 d^2) + norms."""
    per_layer = [3 * d * d, d * d, 4 * d * d, 4 * d * d, d, d, d, d]
    return [vocab * d] + per_layer * layers + [d, d]


class _Syncs:
    """Counts ``Tensor.item``/``tolist`` calls (each a host sync on CUDA): a lower bound on syncs."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> "_Syncs":
        self._item, self._tolist = torch.Tensor.item, torch.Tensor.tolist
        counter = self

        def item(tensor: torch.Tensor, *args: Any):  # type: ignore[no-untyped-def]
            counter.count += tensor.is_cuda
            return counter._item(tensor, *args)

        def tolist(tensor: torch.Tensor, *args: Any):  # type: ignore[no-untyped-def]
            counter.count += tensor.is_cuda
            return counter._tolist(tensor, *args)

        torch.Tensor.item, torch.Tensor.tolist = item, tolist  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        torch.Tensor.item, torch.Tensor.tolist = self._item, self._tolist  # type: ignore[method-assign]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hot_path(device: torch.device, shapes: list[int], repeats: int, deadline: float) -> list[dict[str, Any]]:
    """Section 1 for one set of gradient sizes."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    numel = sum(shapes)
    gradients = [torch.randn(size, generator=generator).to(device) * 1e-2 for size in shapes]
    a, b, c = (torch.randn(numel, device=device) for _ in range(3))
    floor = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        torch.add(a, b, out=c)
        _sync(device)
        floor.append(time.perf_counter() - start)
    floor_ms = statistics.median(floor[1:]) * 1e3
    del a, b, c
    buffer = torch.cat(gradients)
    rows = []
    for name, options in METHODS.items():
        if time.monotonic() > deadline:
            rows.append({"method": name, "skipped": "time budget spent"})
            continue
        pipeline = Pipeline(ExchangeConfig(**options))
        samples: dict[str, list[float]] = {key: [] for key in (*PHASES, "hook", "syncs")}
        try:
            for step in range(repeats + 1):
                flat = buffer.clone()
                group, offset = Group(BufferTarget([flat]), divisor=1.0), 0
                for index, size in enumerate(shapes):
                    group.entries.append(Entry(index, index, flat[offset: offset + size], offset))
                    offset += size
                _sync(device)
                with _Syncs() as syncs:
                    start = time.perf_counter()
                    exchange = pipeline.start(group, step)
                    verdict = pipeline.finish([group], [exchange], step)
                    _sync(device)
                    elapsed = time.perf_counter() - start
                if verdict.error is not None:
                    raise verdict.error
                if step:  # the first step allocates and learns frame sizes
                    for phase in PHASES:
                        samples[phase].append(pipeline.stats.current.get(f"seconds_{phase}", 0.0))
                    samples["hook"].append(elapsed)
                    samples["syncs"].append(float(syncs.count))
                pipeline.stats.end_step()
            row = {"method": name, "numel": numel, "floor_ms": floor_ms}
            for key, values in samples.items():
                row[key if key == "syncs" else f"{key}_ms"] = statistics.median(values) * (1 if key == "syncs" else 1e3)
            row["passes"] = row["hook_ms"] / floor_ms
            rows.append(row)
        except Exception as error:  # reported, and the script's exit status says so
            rows.append({"method": name, "error": f"{type(error).__name__}: {error}"[:300],
                         "traceback": traceback.format_exc()[-1500:]})
    return rows


def codecs(device: torch.device, numel: int, repeats: int, deadline: float) -> list[dict[str, Any]]:
    """Section 2: encode + decode of a top-k 1% selection of CUDA values, per codec pair."""
    import gradwire.codecs as codec_layer
    from gradwire.codecs.base import index_codec_classes

    generator = torch.Generator(device="cpu").manual_seed(1)
    k = numel // 100
    indices = torch.sort(torch.randperm(numel, generator=generator)[:k]).values.to(device)
    values = torch.randn(k, generator=generator).to(device)
    rows = []
    for index_name in sorted(index_codec_classes()):
        for value_name in ("fp16", "fp32"):
            if time.monotonic() > deadline:
                rows.append({"pair": f"{index_name}+{value_name}", "skipped": "time budget spent"})
                continue
            try:
                value_codec, index_codec = codec_layer.resolve_codecs(value_name, index_name, {})
                if not index_codec.lossless:
                    continue  # Bloom needs the dense tensor: exercised by the hook rows above
                encode, decode = [], []
                for _ in range(repeats):
                    _sync(device)
                    start = time.perf_counter()
                    payload = codec_layer.encode_tensors([(values, indices, numel)], index_codec, value_codec).payload
                    middle = time.perf_counter()
                    ((decoded, positions, _),) = codec_layer.decode_tensors(memoryview(payload),
                                                                           expected_numels=[numel])
                    decoded, positions = decoded.to(device), positions.to(device)
                    _sync(device)
                    encode.append(middle - start)
                    decode.append(time.perf_counter() - middle)
                assert torch.equal(positions, indices), "indices changed"
                rows.append({"pair": f"{index_name}+{value_name}", "entries": k, "bytes": len(payload),
                             "encode_ms": statistics.median(encode) * 1e3,
                             "decode_ms": statistics.median(decode) * 1e3})
            except Exception as error:
                rows.append({"pair": f"{index_name}+{value_name}", "error": f"{type(error).__name__}: {error}"[:300]})
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_rank_worker(rank: int, port: int, device_name: str, out: str, collective: str) -> None:
    """One rank of section 3: DDP over gloo with tensors on ``device_name``, 4 steps with the hook."""
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        import gradwire
        from torch.nn.parallel import DistributedDataParallel as DDP

        device = torch.device(device_name)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 10)).to(device))
        options = {"compressor": "topk", "density": 0.05, "collective": collective}
        if collective == "quantized":
            options = {"compressor": "none", "quantize": "int8"}
        state = gradwire.CommHookState(model=model, collective_timeout=30.0, **options)
        model.register_comm_hook(state, gradwire.comm_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            optimizer.zero_grad()
            generator = torch.Generator().manual_seed(10 * rank + step)
            inputs = torch.randn(32, 256, generator=generator).to(device)
            with state.typed_errors():
                model(inputs).square().mean().backward()
            optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu()
        result.update(ok=True, checksum=float(flat.sum()), bytes=state.stats()["total_bytes_sent"])
    except Exception as error:
        result.update(ok=False, error=f"{type(error).__name__}: {error}"[:400])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
        handle.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # PyTorch can abort at interpreter exit after gloo collectives (pytorch PR #179291)


def two_ranks(device: torch.device, deadline: float) -> list[dict[str, Any]]:
    """Section 3: each collective on two ranks sharing the device (gloo)."""
    import torch.multiprocessing as mp

    rows = []
    context = mp.get_context("spawn")
    for collective in ("dense", "allgather", "sparse-allreduce", "quantized"):
        if time.monotonic() > deadline:
            rows.append({"collective": collective, "skipped": "time budget spent"})
            continue
        with tempfile.TemporaryDirectory() as out:
            port = _free_port()
            processes = [context.Process(target=_two_rank_worker, args=(r, port, str(device), out, collective))
                         for r in range(2)]
            for process in processes:
                process.start()
            for process in processes:
                process.join(timeout=max(5.0, min(90.0, deadline - time.monotonic())))
                if process.is_alive():
                    process.kill()
            reports = []
            for r in range(2):
                path = Path(out, f"rank{r}.json")
                reports.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no report"})
        ok = all(r.get("ok") for r in reports)
        same = ok and reports[0]["checksum"] == reports[1]["checksum"]
        rows.append({"collective": collective, "ok": ok, "ranks_identical": same,
                     "bytes": reports[0].get("bytes"),
                     "error": next((r["error"] for r in reports if "error" in r), "")})
    return rows


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}")
    print(format_table(columns, [[_cell(row.get(c, row.get("skipped", row.get("error", "")) if c == columns[-1]
                                             else "")) for c in columns] for row in rows]))


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the same checks, for CI)")
    parser.add_argument("--small", action="store_true", help="small sizes (a quick run of every path)")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for all sections (default 280)")
    parser.add_argument("--json", default=None, help="where to write the numbers (default $OUT/gpu_check.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing to check (use --device cpu for the CPU run)")
        return 0
    device = torch.device(args.device)
    started = time.monotonic()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "small": args.small}
    shape_sets = {"resnet50": resnet50_shapes(), "transformer-1b": transformer_1b_shapes()}
    if args.small:
        shape_sets = {"resnet50/100": [max(1, s // 100) for s in resnet50_shapes()]}
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{folder.name}/store", rank=0, world_size=1)
    failed = False
    try:
        report["hot_path"] = {}
        for name, shapes in shape_sets.items():
            share = started + args.budget * (0.3 if name == "resnet50" or args.small else 0.55)
            rows = hot_path(device, shapes, 3 if args.small else 5, share)
            report["hot_path"][name] = rows
            failed |= any("error" in r for r in rows)
            _table(f"hot path, {name} ({sum(shapes):,} elements, {device}): ms per step",
                   rows, ["method", "floor_ms", *[f"{p}_ms" for p in PHASES], "hook_ms", "passes", "syncs"])
        rows = codecs(device, 1 << (16 if args.small else 24), 2 if args.small else 3,
                      started + args.budget * 0.7)
        report["codecs"] = rows
        failed |= any("error" in r for r in rows)
        _table("codecs on a top-k 1% selection (values on the device)", rows,
               ["pair", "entries", "bytes", "encode_ms", "decode_ms"])
    finally:
        dist.destroy_process_group()
        folder.cleanup()
    rows = two_ranks(device, started + args.budget)
    report["two_ranks"] = rows
    _table("two ranks sharing the device, DDP over gloo", rows,
           ["collective", "ok", "ranks_identical", "bytes", "error"])
    failed |= any(r.get("ok") and not r.get("ranks_identical") for r in rows)  # gloo refusing CUDA is not ours
    report["seconds"] = time.monotonic() - started
    target = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {target}")
    print(f"gpu_check: {report['seconds']:.0f} s, {'FAILED' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # PyTorch can abort at interpreter exit after collectives (pytorch PR #179291)
