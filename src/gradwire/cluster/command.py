"""``gradwire cluster up|down|status``: an emulated bandwidth-limited cluster in network namespaces.

    sudo gradwire cluster up --workers 4 --bandwidth 100mbit
    sudo gradwire cluster up --nodes 2 --workers-per-node 2 --bandwidth 100mbit
    sudo gradwire cluster status            # namespaces, addresses, tc qdiscs (--json for a dict)
    sudo ip netns exec gw-w0 python train.py ...
    sudo gradwire train --cluster ...       # uses the cluster that is up
    sudo gradwire cluster down              # every gradwire cluster not in use by a running launcher

``up`` leaves the cluster running after the command exits and names its prefix in its first
line; ``down`` (no ``--prefix``) deletes every cluster recorded in the state folder whose
launcher is gone — namespaces, links, stray workers, host files, temp folders — including those
of a killed ``gradwire train --cluster``. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from . import state
from .netns import (
    MAX_WORKERS,
    WORKER_INTERFACE,
    ClusterError,
    ClusterSpec,
    down,
    down_all,
    status,
    tbf_parameters,
    up,
    worker_address,
    worker_namespace,
)

ACTIONS = ("up", "down", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire cluster``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("action", choices=ACTIONS, help="up: create the cluster; down: delete it; status: show it")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"up: number of worker namespaces, 1 to {MAX_WORKERS} "
                             "(default 2, or nodes x workers per node)")
    parser.add_argument("--nodes", type=int, default=None, help="up: nodes (default: one per worker)")
    parser.add_argument("--workers-per-node", type=int, default=None,
                        help="up: workers per node; links inside a node are not shaped, each node has one "
                             "rate-limited link up and down (default 1)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="up: rate of each worker's (or, with nodes, each node's) uplink and of its downlink, "
                             "tc units kbit/mbit/gbit (default 1gbit)")
    parser.add_argument("--latency", default="0.5ms",
                        help="up: added one-way worker-to-worker latency, tc units us/ms, or 0 (default 0.5ms; "
                             "needs tc netem in the kernel)")
    parser.add_argument("--prefix", default=None,
                        help="start of every namespace/interface name: a lowercase letter then up to 9 letters or "
                             "digits (up/status default gw; down default: every cluster not in use)")
    parser.add_argument("--json", action="store_true", help="status: print the status as JSON")


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The ClusterSpec of ``up``'s options.

    Raises:
        ValueError: inconsistent or bad options, naming the option.
    """
    per_node = args.workers_per_node or 1
    if args.nodes is not None:
        workers = args.nodes * per_node
        if args.workers is not None and args.workers != workers:
            raise ValueError(f"workers={args.workers} is not nodes x workers_per_node ({args.nodes} x {per_node})")
    else:
        workers = args.workers if args.workers is not None else 2 * per_node
    return ClusterSpec(workers=workers, bandwidth=args.bandwidth, latency=args.latency, prefix=args.prefix or "gw",
                       workers_per_node=per_node)


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire cluster ACTION``; returns 0, 2 on a bad option, 1 when a cluster step failed."""
    try:
        if args.action == "up":
            return _up(args)
        if args.action == "down":
            return _down(args)
        return _status(args)
    except ValueError as error:  # a bad option value
        print(f"gradwire cluster {args.action}: {error}", file=sys.stderr)
        return 2
    except ClusterError as error:  # not root, exists already, an ip/tc step failed
        print(f"gradwire cluster {args.action}: {error}", file=sys.stderr)
        return 1


def _down(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.prefix is not None:
            deleted, in_use = down(args.prefix), []
            nothing = f"no cluster with prefix {args.prefix!r}"
        else:
            deleted, in_use = down_all()
            nothing = "no gradwire cluster to remove"
    for warning in caught:
        print(f"gradwire cluster down: warning: {warning.message}", file=sys.stderr)
    print(f"deleted {', '.join(deleted)}" if deleted else nothing)
    if in_use:
        print(f"left alone (a running `gradwire train` uses them; `--prefix P` removes one anyway): "
              f"{', '.join(in_use)}")
    return 0


def _up(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = up(spec)
    burst = tbf_parameters(spec.rate_bits)["burst"]
    print(f"cluster {spec.prefix!r} is up: {cluster.describe(prefix=False)} (tbf, burst {burst} bytes)")
    for warning in caught:
        print(f"gradwire cluster up: warning: {warning.message}", file=sys.stderr)
    for rank in range(spec.workers):
        node = f", node {spec.node_of(rank)}" if spec.workers_per_node > 1 else ""
        print(f"  rank {rank}: namespace {worker_namespace(spec.prefix, rank)}, address {worker_address(rank)}, "
              f"interface {WORKER_INTERFACE}{node}")
    prefix_option = f" --prefix {spec.prefix}" if spec.prefix != "gw" else ""
    print(f"train on it:              gradwire train --cluster{prefix_option}")
    print(f"run a program as rank 0:  ip netns exec {worker_namespace(spec.prefix, 0)} PROGRAM "
          f"(gloo needs GLOO_SOCKET_IFNAME={WORKER_INTERFACE}, MASTER_ADDR={cluster.master_addr})")
    print(f"remove it:                gradwire cluster down --prefix {spec.prefix}   "
          "(or every cluster: gradwire cluster down)")
    return 0


def _status(args: argparse.Namespace) -> int:
    prefix = args.prefix or "gw"
    records = state.read_all()
    if args.prefix is None and not args.json and records:  # every recorded cluster, one line each
        for record in records:
            owner = record.get("owner")
            use = ("in use by a running launcher" if state.owner_alive(record) else
                   "left by a stopped launcher: `gradwire cluster down` removes it" if owner else "up")
            print(f"{record['prefix']}: {ClusterSpec(**record['spec']).describe(prefix=False)}; {use}")
        print("details of one: gradwire cluster status --prefix P")
        return 0
    report = status(prefix)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not report["exists"]:
        print(f"no cluster with prefix {prefix!r}")
        return 0
    for namespace in report["namespaces"]:
        addresses = ", ".join(report["addresses"][namespace]) or "no address"
        print(f"{namespace}: {addresses}")
        for line in report["qdiscs"][namespace]:
            print(f"  {line}")
    return 0
