"""``gradwire cluster up|down|status``: an emulated bandwidth-limited cluster in network namespaces.

    sudo gradwire cluster up --workers 4 --bandwidth 100mbit --latency 0.5ms
    sudo gradwire cluster status            # namespaces, addresses, tc qdiscs (--json for a dict)
    sudo ip netns exec gw-w0 python train.py ...
    sudo gradwire cluster down

``up`` leaves the cluster running after the command exits; ``down`` deletes every namespace
with the prefix (and with them their interfaces). Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from .netns import (
    WORKER_INTERFACE,
    ClusterError,
    ClusterSpec,
    down,
    status,
    tbf_parameters,
    up,
    worker_address,
    worker_namespace,
)

ACTIONS = ("up", "down", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS, help="up: create the cluster; down: delete it; status: show it")
    parser.add_argument("--workers", type=int, default=2, help="up: number of worker namespaces, 1 to 64 (default 2)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="up: rate of each worker's uplink and of its downlink, tc units kbit/mbit/gbit "
                             "(default 1gbit)")
    parser.add_argument("--latency", default="0.5ms",
                        help="up: added one-way worker-to-worker latency, tc units us/ms, or 0 (default 0.5ms; "
                             "needs tc netem in the kernel)")
    parser.add_argument("--prefix", default="gw",
                        help="start of every namespace/interface name: a lowercase letter then up to 9 letters or "
                             "digits (default gw)")
    parser.add_argument("--json", action="store_true", help="status: print the status as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "up":
            return _up(args)
        if args.action == "down":
            deleted = down(args.prefix)
            print(f"deleted {', '.join(deleted)}" if deleted else f"no cluster with prefix {args.prefix!r}")
            return 0
        return _status(args)
    except ValueError as error:  # a bad option value
        print(f"gradwire cluster {args.action}: {error}", file=sys.stderr)
        return 2
    except ClusterError as error:  # not root, exists already, an ip/tc step failed
        print(f"gradwire cluster {args.action}: {error}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    spec = ClusterSpec(workers=args.workers, bandwidth=args.bandwidth, latency=args.latency, prefix=args.prefix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = up(spec)
    for warning in caught:
        print(f"gradwire cluster up: warning: {warning.message}", file=sys.stderr)
    burst = tbf_parameters(spec.rate_bits)["burst"]
    latency = spec.latency if cluster.latency_emulated else f"{spec.latency} requested, NOT emulated (no tc netem)"
    if spec.latency_us == 0:
        latency = "none added"
    print(f"cluster {spec.prefix!r}: {spec.workers} worker(s); each worker {spec.bandwidth} up and {spec.bandwidth} "
          f"down (tbf, burst {burst} bytes); latency {latency}")
    for rank in range(spec.workers):
        print(f"  rank {rank}: namespace {worker_namespace(spec.prefix, rank)}, address {worker_address(rank)}, "
              f"interface {WORKER_INTERFACE}")
    print(f"run a program as rank 0:  ip netns exec {worker_namespace(spec.prefix, 0)} PROGRAM "
          f"(gloo needs GLOO_SOCKET_IFNAME={WORKER_INTERFACE}, MASTER_ADDR={cluster.master_addr})")
    print(f"remove it:                gradwire cluster down --prefix {spec.prefix}")
    return 0


def _status(args: argparse.Namespace) -> int:
    report = status(args.prefix)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not report["exists"]:
        print(f"no cluster with prefix {args.prefix!r}")
        return 0
    for namespace in report["namespaces"]:
        addresses = ", ".join(report["addresses"][namespace]) or "no address"
        print(f"{namespace}: {addresses}")
        for line in report["qdiscs"][namespace]:
            print(f"  {line}")
    return 0
