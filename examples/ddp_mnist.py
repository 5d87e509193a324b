"""A plain DDP training script on MNIST-5k, made to send ~1% of its gradient with one added line.

Run on 2 local processes (gloo on CPU, NCCL when every rank has a GPU):

    torchrun --nproc_per_node 2 examples/ddp_mnist.py                 # dense AllReduce vs topk 1% + EF
    torchrun --nproc_per_node 2 examples/ddp_mnist.py --methods topk --density 0.01

Each method trains the same model from the same initialization for the same epochs; rank 0
prints test accuracy and the bytes each method put on the wire.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
from gradwire.harness.data import load
from gradwire.harness.models import build_model


def train(method: str, args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(args.seed)  # same initial weights for every method
    model = build_model("cnn", num_classes=10, in_channels=1).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if method != "allreduce":
        state = gradwire.CommHookState(compressor=method, density=args.density, value_codec=args.value_codec,
                                       index_codec=args.index_codec, error_feedback=True, model=ddp_model)
        ddp_model.register_comm_hook(state, gradwire.comm_hook)  # <- the one added line
    train_set, test_set = load("mnist5k")
    sampler = torch.utils.data.distributed.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp_model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    ddp_model.eval()
    with torch.no_grad():
        images, labels = test_set.tensors
        accuracy = float((ddp_model(images.to(device)).argmax(1).cpu() == labels).float().mean())
    parameters = sum(p.numel() for p in model.parameters())
    steps = args.epochs * len(loader)
    world = dist.get_world_size()
    dense_bytes = 2 * (world - 1) / world * 4 * parameters * steps
    sent = state.stats()["total_bytes_sent"] if state is not None else dense_bytes
    return {"method": method, "accuracy": accuracy, "seconds": seconds, "bytes_sent": sent, "bytes_dense": dense_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="allreduce,topk",
                        help="comma-separated: allreduce or a gradwire compressor")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--value-codec", default="fp32")
    parser.add_argument("--index-codec", default="rice")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    results = [train(method.strip(), args, device) for method in args.methods.split(",")]
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} workers, {args.epochs} epochs, MNIST-5k (4,000 train / 1,000 test)")
        print(f"{'method':<12}{'test acc':>10}{'seconds':>10}{'MB sent/worker':>16}{'vs dense':>10}")
        for r in results:
            print(f"{r['method']:<12}{r['accuracy']:>10.4f}{r['seconds']:>10.1f}{r['bytes_sent'] / 1e6:>16.2f}"
                  f"{r['bytes_sent'] / r['bytes_dense']:>10.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
