"""An emulated bandwidth-limited cluster on one Linux machine: network namespaces, veth, bridge, tc.

Layout for ``ClusterSpec(workers=N, prefix="gw")``::

    namespace gw-w0: lo, eth0 10.231.0.1/24 --veth-- gw-h0 ┐
    namespace gw-w1: lo, eth0 10.231.0.2/24 --veth-- gw-h1 ├ bridge gw-br, in namespace gw-hub
    ...                                                     ┘

Every link is shaped in both directions with a token bucket (tc ``tbf``): on egress of the
worker-side ``eth0`` (what the worker sends) and on egress of the hub-side ``gw-h{i}`` (what the
worker receives), so each worker has an uplink and a downlink of ``bandwidth`` each, like a NIC
on a non-blocking switch. A worker-to-worker packet crosses two shaped egresses, so the added
one-way ``latency`` is split in two halves, one per egress (tc ``netem``, when the kernel has it).

With nodes, ``ClusterSpec(workers=4, workers_per_node=2, prefix="gw")``::

    gw-w0: eth0 10.231.0.1 --veth-- gw-h0 ┐ bridge gw-b0   gw-u0 --veth-- gw-d0 ┐
    gw-w1: eth0 10.231.0.2 --veth-- gw-h1 ┘ in node gw-n0  (shaped both ways)   │ bridge gw-br
    gw-w2: eth0 10.231.0.3 --veth-- gw-h2 ┐ bridge gw-b1   gw-u1 --veth-- gw-d1 ┘ in gw-hub
    gw-w3: eth0 10.231.0.4 --veth-- gw-h3 ┘ in node gw-n1  (shaped both ways)

Rank r is on node r // workers_per_node. The workers' own links are not shaped: two workers of
one node talk through their node's bridge at memory speed, while traffic between nodes crosses
the sending node's uplink ``gw-u{j}`` and the receiving node's downlink ``gw-d{j}``, each
``bandwidth``, like one NIC per machine. Its counters give the bytes that crossed nodes.

Inside a namespace no name resolves (no DNS), and c10d warns on every connection that it
cannot name its peer; each worker namespace gets an ``/etc/netns/{namespace}/hosts`` that names
all workers (``ip netns exec`` mounts it over ``/etc/hosts``), removed by :func:`down`.
What a cluster created is recorded in a state file first (:mod:`.state`), so :func:`down_all`
finds everything even after its launcher was killed.

Nothing in the host's own network namespace is created, changed or routed: the bridge lives in
its own hub namespace, the veth ends are created directly inside their namespaces, and the
namespaces have no default route, so traffic between workers cannot leave them. Every name
carries the prefix, which is how :func:`down` finds what :func:`up` made and nothing else.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``)::

    with up(ClusterSpec(workers=2, bandwidth="100mbit")) as cluster:
        subprocess.run(cluster.wrap(0, ["python", "-c", "print('hello from worker 0')"]), check=True)
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..errors import is_integer
from . import state

#: first three octets of the private /24 used only inside the namespaces; rank i gets .(i + 1)
SUBNET_PREFIX = "10.231.0"
SUBNET_BITS = 24
#: name of the worker-side veth end; the same in every worker namespace (each has its own)
WORKER_INTERFACE = "eth0"
#: most workers in one launch; every launcher (local or emulated cluster) keeps to it
MAX_WORKERS = 64
#: prefix: a lowercase letter then up to 9 letters/digits, so that the longest interface name,
#: "{prefix}-h63", fits Linux's 15-character limit (IFNAMSIZ - 1) and no prefix's names can be
#: mistaken for another prefix's (there is no "-" inside a prefix).
PREFIX_PATTERN = re.compile(r"[a-z][a-z0-9]{0,9}")
RATE_PATTERN = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
LATENCY_PATTERN = re.compile(r"(\d+(?:\.\d+)?)(us|ms)")
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units are SI: 1 kbit = 1000 bit/s
LATENCY_UNITS = {"us": 1.0, "ms": 1e3}  # to microseconds

#: smallest token bucket, bytes: must hold at least one 64 KiB GSO/TSO super-packet, or tbf
#: has to split every one of them into MTU-sized segments (CPU) before it can send it
MIN_BURST_BYTES = 64 * 1024 + 4 * 1024
#: the bucket also holds this much time of traffic at the full rate: tbf refills on timer
#: ticks, and a bucket smaller than rate x tick caps the throughput below the rate
BURST_SECONDS = 0.004  # one tick at HZ=250
#: queue behind the bucket, bytes: max(1 MiB, 20 ms at the rate), about a NIC's 1000-packet
#: pfifo at 100 Mbit/s. Measured here: 64 KiB to 4 MiB all give the full rate for one TCP flow
#: (a sender on this host is throttled by backpressure or local drops alike); a deeper queue
#: only adds delay for small messages stuck behind a bulk transfer (bufferbloat).
QUEUE_SECONDS = 0.02
MIN_QUEUE_BYTES = 1024 * 1024

#: where ``ip netns exec`` finds files to mount over /etc inside a namespace (iproute2's convention)
NETNS_ETC = "/etc/netns"

NEEDS_ROOT = ("gradwire cluster needs root (CAP_NET_ADMIN) to create network namespaces; "
              "run as root or use local workers")


class ClusterError(RuntimeError):
    """A namespace, link or qdisc could not be created, inspected or deleted."""


class ClusterUnavailableError(ClusterError):
    """This process cannot build clusters here: not root, no iproute2, or no namespace support."""


class ClusterExistsError(ClusterError):
    """Namespaces with this prefix already exist."""


def parse_rate(option: str, value: str) -> int:
    """Bits per second of a tc rate such as ``"100mbit"`` (units kbit, mbit, gbit; SI, 1 kbit = 1000 bit/s).

    Raises:
        ValueError: not a rate of at least 8 kbit, naming ``option``.
    """
    match = RATE_PATTERN.fullmatch(str(value).strip().lower())
    bits = float(match.group(1)) * RATE_UNITS[match.group(2)] if match else 0.0
    if not match or bits < 8000:
        raise ValueError(f"{option}={value!r} is not a rate; allowed: a number >= 8kbit followed by kbit, mbit or gbit "
                         f"(e.g. 100mbit, 1gbit, 2.5gbit)")
    return int(bits)


def parse_latency(option: str, value: str) -> float:
    """Microseconds of a tc time such as ``"0.5ms"`` (units us, ms); ``"0"`` means no added latency.

    Raises:
        ValueError: not a latency of at most 10 s, naming ``option``.
    """
    text = str(value).strip().lower()
    if text == "0":
        return 0.0
    match = LATENCY_PATTERN.fullmatch(text)
    if not match or float(match.group(1)) * LATENCY_UNITS[match.group(2)] > 10e6:
        raise ValueError(f"{option}={value!r} is not a latency; allowed: 0 or a number followed by us or ms, "
                         f"at most 10000ms (e.g. 500us, 0.5ms, 20ms)")
    return float(match.group(1)) * LATENCY_UNITS[match.group(2)]


@dataclass(frozen=True)
class ClusterSpec:
    """What to build: ``workers`` namespaces, each with ``bandwidth`` up and ``bandwidth`` down.

    Attributes:
        workers: worker namespaces (ranks), 1 to :data:`MAX_WORKERS`.
        bandwidth: a tc rate (``"100mbit"``, ``"1gbit"``; bits per second, SI units).
        latency: the added one-way delay between two workers (``"500us"``, ``"0.5ms"``, ``"0"``).
        prefix: the start of every namespace and interface name (lowercase letter, then up to 9
            letters or digits).
        workers_per_node: > 1 groups ranks into nodes (rank r on node r // workers_per_node):
            unshaped links inside a node, ``bandwidth`` up and down per node; a divisor of
            ``workers``.

    Raises:
        ValueError: a bad value, naming the option.
    """

    workers: int
    bandwidth: str = "1gbit"
    latency: str = "0.5ms"
    prefix: str = "gw"
    workers_per_node: int = 1

    def __post_init__(self) -> None:
        if not is_integer(self.workers) or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers={self.workers!r} is not supported; allowed: an integer from 1 to {MAX_WORKERS}")
        per_node = self.workers_per_node
        if not is_integer(per_node) or not 1 <= per_node <= self.workers \
                or self.workers % per_node:
            raise ValueError(f"workers_per_node={per_node!r} is not supported; allowed: a divisor of "
                             f"workers={self.workers} (1 to {self.workers})")
        parse_rate("bandwidth", self.bandwidth)
        parse_latency("latency", self.latency)
        if not isinstance(self.prefix, str) or not PREFIX_PATTERN.fullmatch(self.prefix):
            raise ValueError(f"prefix={self.prefix!r} is not supported; allowed: a lowercase letter followed by at "
                             f"most 9 lowercase letters or digits (e.g. gw, gwt3f9a)")

    @property
    def rate_bits(self) -> int:
        """The bandwidth in bits per second."""
        return parse_rate("bandwidth", self.bandwidth)

    @property
    def latency_us(self) -> float:
        """The added one-way worker-to-worker latency in microseconds."""
        return parse_latency("latency", self.latency)

    @property
    def nodes(self) -> int:
        """Number of nodes (each worker is its own node when ``workers_per_node`` is 1)."""
        return self.workers // self.workers_per_node

    def node_of(self, rank: int) -> int:
        """The node that rank ``rank`` runs on."""
        return rank // self.workers_per_node

    def describe(self, *, prefix: bool = True) -> str:
        """One line: (prefix,) size, rates."""
        if self.workers_per_node == 1:
            shape = f"{self.workers} worker(s), each {self.bandwidth} up and down"
        else:
            shape = (f"{self.nodes} nodes x {self.workers_per_node} workers, each node {self.bandwidth} up and down, "
                     f"unshaped inside a node")
        latency = "no added latency" if self.latency_us == 0 else f"latency {self.latency}"
        return f"prefix {self.prefix!r}, {shape}, {latency}" if prefix else f"{shape}, {latency}"


# ---------------------------------------------------------------------------------------- names


def hub_namespace(prefix: str) -> str:
    """Name of the namespace that holds the bridge."""
    return f"{prefix}-hub"


def worker_namespace(prefix: str, rank: int) -> str:
    """Name of rank ``rank``'s namespace."""
    return f"{prefix}-w{rank}"


def bridge_name(prefix: str) -> str:
    """Name of the bridge (inside the hub namespace)."""
    return f"{prefix}-br"


def hub_link_name(prefix: str, rank: int) -> str:
    """Name of the hub-side veth end toward rank ``rank`` (inside the hub namespace)."""
    return f"{prefix}-h{rank}"


def node_namespace(prefix: str, node: int) -> str:
    """Name of node ``node``'s namespace (node layout only): its bridge and its uplink."""
    return f"{prefix}-n{node}"


def node_bridge_name(prefix: str, node: int) -> str:
    """Name of node ``node``'s bridge (inside the node's namespace)."""
    return f"{prefix}-b{node}"


def uplink_name(prefix: str, node: int) -> str:
    """Node-side end of node ``node``'s shaped link to the hub (egress: what the node sends)."""
    return f"{prefix}-u{node}"


def downlink_name(prefix: str, node: int) -> str:
    """Hub-side end of node ``node``'s shaped link (egress: what the node receives)."""
    return f"{prefix}-d{node}"


def worker_address(rank: int) -> str:
    """IPv4 address of rank ``rank`` (no prefix length)."""
    return f"{SUBNET_PREFIX}.{rank + 1}"


def _owned_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-(?:hub|w\d+|n\d+)")


# ----------------------------------------------------------------------------------- subprocess


def _tool(name: str) -> str | None:
    """Absolute path of ``ip``/``tc``: PATH first, then the sbin folders a non-login root shell may lack."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _run(argv: Sequence[str], what: str, timeout: float = 30.0) -> str:
    """Run one iproute2 command; return its stdout, or raise ClusterError with ``what`` and its stderr."""
    tool = _tool(argv[0])
    if tool is None:
        raise ClusterUnavailableError(f"{NEEDS_ROOT} ({argv[0]!r} from iproute2 was not found)")
    try:
        done = subprocess.run([tool, *argv[1:]], check=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.CalledProcessError as error:
        detail = (error.stderr or error.stdout or "").strip() or f"exit status {error.returncode}"
        if "Operation not permitted" in detail or "Permission denied" in detail:
            raise ClusterUnavailableError(f"{NEEDS_ROOT} ({what}: {detail})") from None
        raise ClusterError(f"{what} failed: `{' '.join(argv)}`: {detail}") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what} failed: `{' '.join(argv)}` did not finish within {timeout} s") from None
    return done.stdout


@functools.lru_cache(maxsize=1)
def cluster_available() -> tuple[bool, str]:
    """``(True, "")`` if this process can build clusters, else ``(False, why)``; for tests to skip on.

    Beyond root and iproute2 this builds and deletes a throwaway namespace with a veth pair and
    a tbf qdisc, since containers can be root without the capabilities or kernel features.
    Cached: the answer does not change while the process runs.
    """
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, NEEDS_ROOT
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            return False, f"{NEEDS_ROOT} ({tool!r} from iproute2 was not found)"
    probe = f"gwprobe-{os.getpid()}"  # no "-hub"/"-wN" ending: no cluster's down() can mistake it for its own
    try:
        _run(["ip", "netns", "add", probe], "creating a probe namespace")
        try:
            _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                 "creating a probe veth")
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit", "burst", "32kb",
                  "latency", "10ms"], "adding a probe tbf qdisc")
        finally:
            _run(["ip", "netns", "delete", probe], "deleting the probe namespace")
    except ClusterError as error:
        return False, str(error)
    return True, ""


def require_available() -> None:
    """Raise ClusterUnavailableError (with the reason) unless :func:`cluster_available`."""
    ok, why = cluster_available()
    if not ok:
        raise ClusterUnavailableError(why)


# ------------------------------------------------------------------------------------ inspection


def list_namespaces(prefix: str = "gw") -> list[str]:
    """Existing namespaces named like a cluster with this prefix makes: hub first, then nodes, then workers."""
    output = _run(["ip", "netns", "list"], "listing network namespaces")
    pattern = _owned_pattern(prefix)
    names = [line.split()[0] for line in output.splitlines() if line.strip()]
    owned = [name for name in names if pattern.fullmatch(name)]
    hub = hub_namespace(prefix)

    def order(name: str) -> tuple[int, int]:
        if name == hub:
            return (0, 0)
        kind, number = name.rsplit("-", 1)[1][0], int(name.rsplit("-", 1)[1][1:])
        return (1 if kind == "n" else 2, number)

    return sorted(owned, key=order)


def status(prefix: str = "gw") -> dict[str, Any]:
    """What exists for ``prefix``: namespaces, and per namespace its IPv4 addresses and qdisc lines.

    Returns:
        ``{"prefix": "gw", "exists": True, "namespaces": ["gw-hub", "gw-w0", ...],
        "addresses": {"gw-w0": ["10.231.0.1/24"], ...},
        "qdiscs": {"gw-w0": ["qdisc tbf 8001: dev eth0 root ..."], ...}}``.

    Raises:
        ClusterError: ``ip``/``tc`` failed.
    """
    namespaces = list_namespaces(prefix)
    addresses: dict[str, list[str]] = {}
    qdiscs: dict[str, list[str]] = {}
    for namespace in namespaces:
        brief = _run(["ip", "-n", namespace, "-4", "-o", "addr", "show"], f"listing addresses in {namespace}")
        addresses[namespace] = [fields[3] for fields in (line.split() for line in brief.splitlines())
                                if len(fields) > 3 and fields[2] == "inet" and fields[1] != "lo"]
        shown = _run(["tc", "-n", namespace, "qdisc", "show"], f"listing qdiscs in {namespace}")
        # noqueue on lo/bridge says nothing about the shaping; keep the qdiscs that do
        qdiscs[namespace] = [line.strip() for line in shown.splitlines() if line.strip() and "noqueue" not in line]
    return {"prefix": prefix, "exists": bool(namespaces), "namespaces": namespaces, "addresses": addresses,
            "qdiscs": qdiscs}


# -------------------------------------------------------------------------------------- shaping


def tbf_parameters(rate_bits: int) -> dict[str, int]:
    """Token-bucket sizes for ``rate_bits`` bit/s: ``{"burst": bytes, "limit": bytes}``.

    burst = max(68 KiB, 4 ms at the rate): at least one GSO super-packet, at least one timer
    tick's worth (a smaller bucket caps the rate below the setting, worse the higher the rate).
    limit = burst + max(1 MiB, 20 ms at the rate): the queue behind the bucket.
    """
    rate_bytes = rate_bits / 8
    burst = max(MIN_BURST_BYTES, math.ceil(rate_bytes * BURST_SECONDS))
    limit = burst + max(MIN_QUEUE_BYTES, math.ceil(rate_bytes * QUEUE_SECONDS))
    return {"burst": burst, "limit": limit}


def _shape(namespace: str, device: str, spec: ClusterSpec, use_netem: bool) -> None:
    """Rate-limit (and, with ``use_netem``, delay by half the latency) the egress of ``device``."""
    params = tbf_parameters(spec.rate_bits)
    tbf = ["tbf", "rate", f"{spec.rate_bits}bit", "burst", str(params["burst"]), "limit", str(params["limit"])]
    if not use_netem:
        _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *tbf],
             f"shaping {device} in {namespace}")
        return
    # netem first (holds each packet for the delay), tbf as its child (then paces it at the rate):
    # netem's own "rate" option is per-packet serialisation without bursts and GSO-unaware.
    # netem's queue must hold everything in flight during the delay plus tbf's queue, in packets.
    half_us = max(1, round(spec.latency_us / 2))
    packets = max(1000, math.ceil((params["limit"] + spec.rate_bits / 8 * half_us / 1e6) / 1500) * 2)
    _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "handle", "1:", "netem",
          "delay", f"{half_us}us", "limit", str(packets)], f"delaying {device} in {namespace}")
    _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf],
         f"shaping {device} in {namespace}")


def _netem_available(namespace: str, device: str) -> bool:
    """Whether the kernel has tc netem (many minimal kernels, e.g. microVMs, ship without it)."""
    try:
        _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "netem", "delay", "1us"],
             "probing tc netem")
    except ClusterError as error:
        if "unknown" in str(error).lower() or "no such file" in str(error).lower():
            return False
        raise
    _run(["tc", "-n", namespace, "qdisc", "delete", "dev", device, "root"], "removing the netem probe")
    return True


# -------------------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    """A running emulated cluster; a context manager that tears it down on exit (even on Ctrl-C).

    Attributes:
        spec: what was built.
        latency_emulated: False when ``spec.latency`` was nonzero but the kernel has no tc netem,
            so only the bandwidth is emulated (a warning says so when the cluster comes up).
        closed: True once :meth:`down` ran.
    """

    spec: ClusterSpec
    latency_emulated: bool
    closed: bool = field(default=False, compare=False)

    @property
    def namespaces(self) -> list[str]:
        """Worker namespace names, by rank."""
        return [worker_namespace(self.spec.prefix, rank) for rank in range(self.spec.workers)]

    @property
    def node_namespaces(self) -> list[str]:
        """Node namespace names, by node (empty when every worker is its own node)."""
        if self.spec.workers_per_node == 1:
            return []
        return [node_namespace(self.spec.prefix, node) for node in range(self.spec.nodes)]

    @property
    def hub_namespace(self) -> str:
        """The namespace that holds the bridge and the hub-side links."""
        return hub_namespace(self.spec.prefix)

    @property
    def addresses(self) -> list[str]:
        """IPv4 address of each worker, by rank."""
        return [worker_address(rank) for rank in range(self.spec.workers)]

    @property
    def master_addr(self) -> str:
        """Rank 0's address, for MASTER_ADDR."""
        return worker_address(0)

    def describe(self, *, prefix: bool = True) -> str:
        """One line: the spec, and whether the latency is emulated."""
        text = self.spec.describe(prefix=prefix)
        if self.spec.latency_us > 0 and not self.latency_emulated:
            text += " (NOT emulated: no tc netem)"
        return text

    def node_of(self, rank: int) -> int:
        """The node that rank ``rank`` runs on."""
        self._check_rank(rank)
        return self.spec.node_of(rank)

    def interface(self, rank: int) -> str:
        """Worker-side interface name inside rank ``rank``'s namespace (for GLOO_SOCKET_IFNAME)."""
        self._check_rank(rank)
        return WORKER_INTERFACE

    def wrap(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace: ``[ip, "netns", "exec", namespace, *argv]``.

        ``ip netns exec`` execs ``argv`` in place, so the child's pid is the program's own pid.
        """
        self._check_rank(rank)
        return [_tool("ip") or "ip", "netns", "exec", worker_namespace(self.spec.prefix, rank), *argv]

    def bytes_sent(self, rank: int) -> int:
        """Bytes worker ``rank``'s interface has transmitted so far (kernel counter, headers included)."""
        self._check_rank(rank)
        return _link_counters(self.namespaces[rank], WORKER_INTERFACE)[0]

    def counters(self) -> dict[str, list[int]]:
        """Kernel byte counters (headers included) since the cluster came up, read now:

        ``tx_bytes``/``rx_bytes``: per rank, on the worker's ``eth0`` (all its traffic);
        ``node_tx_bytes``/``node_rx_bytes``: per node, what crossed the node's shaped link out
        of / into the node — the cross-node traffic (with one worker per node, the worker's own).
        Subtract two readings to get the bytes of what ran in between.
        """
        per_rank = [_link_counters(namespace, WORKER_INTERFACE) for namespace in self.namespaces]
        if self.spec.workers_per_node == 1:
            per_node = per_rank
        else:
            per_node = [_link_counters(namespace, uplink_name(self.spec.prefix, node))
                        for node, namespace in enumerate(self.node_namespaces)]
        return {"tx_bytes": [tx for tx, _ in per_rank], "rx_bytes": [rx for _, rx in per_rank],
                "node_tx_bytes": [tx for tx, _ in per_node], "node_rx_bytes": [rx for _, rx in per_node]}

    def down(self) -> list[str]:
        """Delete this cluster's namespaces (see :func:`down`); safe to call more than once."""
        self.closed = True
        return down(self.spec.prefix)

    def _check_rank(self, rank: int) -> None:
        if not is_integer(rank) or not 0 <= rank < self.spec.workers:
            raise ValueError(f"rank={rank!r} is not supported; allowed: 0 to {self.spec.workers - 1}")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        # runs for every exception, KeyboardInterrupt included; never masks the original one
        self.down()


def _link_counters(namespace: str, device: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``device`` in ``namespace``: one ``ip -s`` call, no shell."""
    text = _run(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", device], f"reading counters of {device}")
    import json

    stats = json.loads(text)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def _planned_namespaces(spec: ClusterSpec) -> list[str]:
    nodes = [] if spec.workers_per_node == 1 else [node_namespace(spec.prefix, n) for n in range(spec.nodes)]
    return [hub_namespace(spec.prefix), *nodes, *(worker_namespace(spec.prefix, r) for r in range(spec.workers))]


def _write_hosts(spec: ClusterSpec) -> list[str]:
    """An /etc/netns/{worker namespace}/hosts per worker naming every worker; returns the folders."""
    # c10d's store listens on "::", so it sees peers as IPv4-mapped IPv6 addresses: name both forms
    lines = "".join(f"{worker_address(r)} {worker_namespace(spec.prefix, r)}\n"
                    f"::ffff:{worker_address(r)} {worker_namespace(spec.prefix, r)}\n" for r in range(spec.workers))
    folders = []
    for rank in range(spec.workers):
        folder = os.path.join(NETNS_ETC, worker_namespace(spec.prefix, rank))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as handle:
            handle.write("127.0.0.1 localhost\n" + lines)
        folders.append(folder)
    return folders


def temporary_prefix() -> str:
    """A prefix no other live launch uses: ``g`` + pid + a counter (at most 10 characters)."""
    global _launches
    _launches += 1
    return f"g{os.getpid() % 10**6}{_launches % 1000}"


_launches = 0


def up(spec: ClusterSpec, *, owner_pid: Optional[int] = None, temp_dir: Optional[str] = None) -> Cluster:
    """Build the cluster ``spec`` describes and return it; on any failure delete what was built.

    The state file (:mod:`.state`) is written first, with the names about to be created, so
    that :func:`down` finds them whatever happens next. About 10 ms per ``ip``/``tc`` call,
    roughly 10 calls per worker.

    Args:
        spec: what to build.
        owner_pid: a launcher whose death makes the cluster an orphan for :func:`down_all`;
            None for a cluster that stays up until ``down``.
        temp_dir: a launch folder that ``down`` removes too.

    Returns:
        The running :class:`Cluster`.

    Raises:
        ClusterUnavailableError: not root, no iproute2, or no namespace support.
        ClusterExistsError: namespaces with the prefix exist already.
        ClusterError: a step failed.
    """
    require_available()
    prefix = spec.prefix
    existing = list_namespaces(prefix)
    if existing:
        raise ClusterExistsError(f"a cluster with prefix {prefix!r} exists already ({', '.join(existing)}); "
                                 f"remove it with `gradwire cluster down --prefix {prefix}` or pick another --prefix")
    record: dict[str, Any] = {
        "prefix": prefix, "spec": asdict(spec), "namespaces": _planned_namespaces(spec),
        "etc_folders": [os.path.join(NETNS_ETC, worker_namespace(prefix, r)) for r in range(spec.workers)],
        "owner": state.owner(owner_pid) if owner_pid is not None else None, "temp_dir": temp_dir,
        "latency_emulated": False, "created": time.time(),
    }
    state.write(prefix, record)
    try:
        use_netem = _build(spec)
        _write_hosts(spec)
    except BaseException:  # KeyboardInterrupt half-way included: leave nothing behind
        try:
            down(prefix)
        except ClusterError as cleanup_error:
            warnings.warn(f"cleanup after a failed `up` failed too: {cleanup_error}", RuntimeWarning, stacklevel=2)
        raise
    state.write(prefix, {**record, "latency_emulated": use_netem})
    return Cluster(spec=spec, latency_emulated=use_netem)


def _build(spec: ClusterSpec) -> bool:
    """Create the namespaces, links and qdiscs; returns whether latency is emulated (netem)."""
    prefix = spec.prefix
    hub, bridge = hub_namespace(prefix), bridge_name(prefix)
    nodes = spec.workers_per_node > 1
    use_netem = False
    _run(["ip", "netns", "add", hub], f"creating namespace {hub}")
    _run(["ip", "-n", hub, "link", "set", "lo", "up"], f"bringing up lo in {hub}")
    # STP is off by default, so ports forward at once (no 15 s listening/learning delay)
    _run(["ip", "-n", hub, "link", "add", bridge, "type", "bridge"], f"creating bridge {bridge} in {hub}")
    _run(["ip", "-n", hub, "link", "set", bridge, "up"], f"bringing up {bridge} in {hub}")
    if nodes:
        for node in range(spec.nodes):
            namespace, node_bridge = node_namespace(prefix, node), node_bridge_name(prefix, node)
            up_link, down_link = uplink_name(prefix, node), downlink_name(prefix, node)
            _run(["ip", "netns", "add", namespace], f"creating namespace {namespace}")
            _run(["ip", "-n", namespace, "link", "add", node_bridge, "type", "bridge"],
                 f"creating bridge {node_bridge}")
            _run(["ip", "-n", namespace, "link", "set", node_bridge, "up"], f"bringing up {node_bridge}")
            _run(["ip", "link", "add", up_link, "netns", namespace, "type", "veth", "peer", "name", down_link,
                  "netns", hub], f"creating the node link {up_link}/{down_link}")
            _run(["ip", "-n", namespace, "link", "set", up_link, "master", node_bridge], f"attaching {up_link}")
            _run(["ip", "-n", hub, "link", "set", down_link, "master", bridge], f"attaching {down_link}")
            _run(["ip", "-n", namespace, "link", "set", up_link, "up"], f"bringing up {up_link}")
            _run(["ip", "-n", hub, "link", "set", down_link, "up"], f"bringing up {down_link}")
            if node == 0 and spec.latency_us > 0:
                use_netem = _probe_netem(spec, namespace, up_link)
            _shape(namespace, up_link, spec, use_netem)  # what the node sends to other nodes
            _shape(hub, down_link, spec, use_netem)  # what the node receives from other nodes
    for rank in range(spec.workers):
        namespace, link = worker_namespace(prefix, rank), hub_link_name(prefix, rank)
        # a worker hangs off its node's bridge (unshaped) or, one per node, off the hub (shaped)
        parent = node_namespace(prefix, spec.node_of(rank)) if nodes else hub
        parent_bridge = node_bridge_name(prefix, spec.node_of(rank)) if nodes else bridge
        _run(["ip", "netns", "add", namespace], f"creating namespace {namespace}")
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"], f"bringing up lo in {namespace}")
        # both ends are born inside their namespaces: nothing appears in the host's namespace,
        # and "eth0" cannot clash with the host's own interfaces
        _run(["ip", "link", "add", link, "netns", parent, "type", "veth", "peer", "name", WORKER_INTERFACE,
              "netns", namespace], f"creating the veth pair {link}/{WORKER_INTERFACE} for {namespace}")
        _run(["ip", "-n", parent, "link", "set", link, "master", parent_bridge], f"attaching {link} to {parent_bridge}")
        _run(["ip", "-n", parent, "link", "set", link, "up"], f"bringing up {link} in {parent}")
        _run(["ip", "-n", namespace, "addr", "add", f"{worker_address(rank)}/{SUBNET_BITS}", "dev",
              WORKER_INTERFACE], f"addressing {WORKER_INTERFACE} in {namespace}")
        _run(["ip", "-n", namespace, "link", "set", WORKER_INTERFACE, "up"],
             f"bringing up {WORKER_INTERFACE} in {namespace}")
        if nodes:
            continue
        if rank == 0 and spec.latency_us > 0:
            use_netem = _probe_netem(spec, namespace, WORKER_INTERFACE)
        _shape(namespace, WORKER_INTERFACE, spec, use_netem)  # what the worker sends
        _shape(hub, link, spec, use_netem)  # what the worker receives
    return use_netem


def _probe_netem(spec: ClusterSpec, namespace: str, device: str) -> bool:
    use_netem = _netem_available(namespace, device)
    if not use_netem:
        warnings.warn(f"this kernel has no tc netem (CONFIG_NET_SCH_NETEM); latency={spec.latency!r} is "
                      f"not emulated, only bandwidth={spec.bandwidth!r}", RuntimeWarning, stacklevel=3)
    return use_netem


def find(prefix: str = "gw") -> Optional[Cluster]:
    """The cluster ``prefix`` that is up and free to use, from its state file.

    Returns:
        The cluster ``gradwire cluster up`` made (no owner), or None if there is none, it belongs
        to a launcher, or some of its namespaces are gone.
    """
    record = state.read(prefix)
    if record is None or state.owner_alive(record) or record.get("owner"):
        return None
    if _tool("ip") is None or set(record["namespaces"]) - set(list_namespaces(prefix)):
        return None
    return Cluster(spec=ClusterSpec(**record["spec"]), latency_emulated=bool(record.get("latency_emulated")))


def _kill_namespace_processes(namespaces: Sequence[str]) -> list[int]:
    """SIGKILL every process in ``namespaces`` (stray workers); returns their pids."""
    killed = []
    for namespace in namespaces:
        try:
            listed = _run(["ip", "netns", "pids", namespace], f"listing processes in {namespace}")
            pids = [int(pid) for pid in listed.split()]
        except ClusterError:
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5  # a killed process leaves its namespace when it is reaped or gone
    while killed and time.monotonic() < deadline and any(state.process_start_time(pid) for pid in killed):
        time.sleep(0.05)
    return killed


def down(prefix: str = "gw") -> list[str]:
    """Delete everything cluster ``prefix`` made; return the namespace names deleted.

    Processes still inside its namespaces (stray workers) are killed first. Deleting a namespace
    deletes the interfaces inside it (bridges, veth ends), so no interface is touched by name and
    none outside these namespaces at all. Then the ``/etc/netns`` host files, the recorded launch
    folder (an orphan's only: a live owner removes its own) and the state file go. Safe when
    nothing exists.

    Args:
        prefix: the cluster's prefix.

    Returns:
        The namespace names deleted.

    Raises:
        ValueError: not a valid prefix.
        ClusterError: a namespace could not be deleted.
    """
    if not PREFIX_PATTERN.fullmatch(str(prefix)):
        raise ValueError(f"prefix={prefix!r} is not supported; allowed: a lowercase letter followed by at most 9 "
                         f"lowercase letters or digits")
    record = state.read(prefix) or {}
    deleted = []
    if _tool("ip") is not None:  # without iproute2 no namespace can have been created
        namespaces = list_namespaces(prefix)
        _kill_namespace_processes(namespaces)
        # workers first, then nodes: the hub goes last so a bridge outlives every link attached to it
        for namespace in reversed(namespaces):
            try:
                _run(["ip", "netns", "delete", namespace], f"deleting namespace {namespace}")
            except ClusterError:
                if namespace in list_namespaces(prefix):  # gone meanwhile (a concurrent down) is fine
                    raise
                continue
            deleted.append(namespace)
    for folder in record.get("etc_folders", []):
        if os.path.dirname(folder) == NETNS_ETC and _owned_pattern(prefix).fullmatch(os.path.basename(folder)):
            shutil.rmtree(folder, ignore_errors=True)
    temp_dir = record.get("temp_dir")
    # a live owner (the launcher, on its way out) removes its own folder; an orphan's goes here
    if temp_dir and not state.owner_alive(record) \
            and os.path.dirname(os.path.abspath(temp_dir)) == os.path.abspath(tempfile.gettempdir()) \
            and os.path.basename(temp_dir).startswith("gradwire-"):
        shutil.rmtree(temp_dir, ignore_errors=True)
    state.remove(prefix)
    return deleted


def down_all() -> tuple[list[str], list[str]]:
    """Delete every recorded cluster except those a live launcher is using.

    A cluster of a killed launcher has a dead owner and is deleted with its stray workers and
    temp folder.

    Returns:
        (namespaces deleted, prefixes left alone because their owner runs).
    """
    deleted: list[str] = []
    in_use: list[str] = []
    for record in state.read_all():
        if state.owner_alive(record):
            in_use.append(record["prefix"])
            continue
        deleted += down(record["prefix"])
    return deleted, in_use
