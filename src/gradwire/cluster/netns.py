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
import subprocess
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

#: first three octets of the private /24 used only inside the namespaces; rank i gets .(i + 1)
SUBNET_PREFIX = "10.231.0"
SUBNET_BITS = 24
#: name of the worker-side veth end; the same in every worker namespace (each has its own)
WORKER_INTERFACE = "eth0"
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

NEEDS_ROOT = "gradwire cluster needs root (CAP_NET_ADMIN) to create network namespaces; run as root or use local workers"


class ClusterError(RuntimeError):
    """A namespace, link or qdisc could not be created, inspected or deleted."""


class ClusterUnavailableError(ClusterError):
    """This process cannot build clusters here: not root, no iproute2, or no namespace support."""


class ClusterExistsError(ClusterError):
    """Namespaces with this prefix already exist."""


def parse_rate(option: str, value: str) -> int:
    """Bits per second of a tc rate such as ``"100mbit"`` (units kbit, mbit, gbit; SI, 1 kbit = 1000 bit/s)."""
    match = RATE_PATTERN.fullmatch(str(value).strip().lower())
    bits = float(match.group(1)) * RATE_UNITS[match.group(2)] if match else 0.0
    if not match or bits < 8000:
        raise ValueError(f"{option}={value!r} is not a rate; allowed: a number >= 8kbit followed by kbit, mbit or gbit "
                         f"(e.g. 100mbit, 1gbit, 2.5gbit)")
    return int(bits)


def parse_latency(option: str, value: str) -> float:
    """Microseconds of a tc time such as ``"0.5ms"`` (units us, ms); ``"0"`` means no added latency."""
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

    ``bandwidth`` is a tc rate (``"100mbit"``, ``"1gbit"``; bits per second, SI units),
    ``latency`` the added one-way delay between two workers (``"500us"``, ``"0.5ms"``, ``"0"``),
    ``prefix`` the start of every namespace and interface name (lowercase letter, then up to 9
    letters or digits). Raises ``ValueError`` naming the option on a bad value.
    """

    workers: int
    bandwidth: str = "1gbit"
    latency: str = "0.5ms"
    prefix: str = "gw"

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers={self.workers!r} is not supported; allowed: an integer from 1 to {MAX_WORKERS}")
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


def worker_address(rank: int) -> str:
    """IPv4 address of rank ``rank`` (no prefix length)."""
    return f"{SUBNET_PREFIX}.{rank + 1}"


def _owned_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-(?:hub|w\d+)")


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
            _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], "creating a probe veth")
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
    """Existing namespaces named like a cluster with this prefix makes: hub first, then workers by rank."""
    output = _run(["ip", "netns", "list"], "listing network namespaces")
    pattern = _owned_pattern(prefix)
    names = [line.split()[0] for line in output.splitlines() if line.strip()]
    owned = [name for name in names if pattern.fullmatch(name)]
    hub = hub_namespace(prefix)

    def order(name: str) -> tuple[int, int]:
        return (0, 0) if name == hub else (1, int(name.rsplit("-w", 1)[1]))

    return sorted(owned, key=order)


def status(prefix: str = "gw") -> dict[str, Any]:
    """What exists for ``prefix``: namespaces, and per namespace its IPv4 addresses and qdisc lines.

    ``{"prefix": "gw", "exists": True, "namespaces": ["gw-hub", "gw-w0", ...],
    "addresses": {"gw-w0": ["10.231.0.1/24"], ...}, "qdiscs": {"gw-w0": ["qdisc tbf 8001: dev eth0 root ..."], ...}}``
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
        _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *tbf], f"shaping {device} in {namespace}")
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

    ``latency_emulated`` is False when ``spec.latency`` was nonzero but the kernel has no tc
    netem, so only the bandwidth is emulated (a warning says so when the cluster comes up).
    """

    spec: ClusterSpec
    latency_emulated: bool
    closed: bool = field(default=False, compare=False)

    @property
    def namespaces(self) -> list[str]:
        """Worker namespace names, by rank."""
        return [worker_namespace(self.spec.prefix, rank) for rank in range(self.spec.workers)]

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
        text = _run(["ip", "netns", "exec", self.namespaces[rank], "cat",
                     f"/sys/class/net/{self.interface(rank)}/statistics/tx_bytes"], "read tx_bytes")
        return int(text.strip())

    def down(self) -> list[str]:
        """Delete this cluster's namespaces (see :func:`down`); safe to call more than once."""
        self.closed = True
        return down(self.spec.prefix)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.spec.workers:
            raise ValueError(f"rank={rank!r} is not supported; allowed: 0 to {self.spec.workers - 1}")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        # runs for every exception, KeyboardInterrupt included; never masks the original one
        self.down()


def up(spec: ClusterSpec) -> Cluster:
    """Build the cluster ``spec`` describes and return it; on any failure delete what was built.

    Raises ClusterUnavailableError without root/iproute2, ClusterExistsError if namespaces with
    the prefix exist already, ClusterError if a step fails. Takes about 10 ms per ``ip``/``tc``
    call, roughly 10 calls per worker.
    """
    require_available()
    prefix = spec.prefix
    existing = list_namespaces(prefix)
    if existing:
        raise ClusterExistsError(f"a cluster with prefix {prefix!r} exists already ({', '.join(existing)}); "
                                 f"remove it with `gradwire cluster down --prefix {prefix}` or pick another --prefix")
    hub, bridge = hub_namespace(prefix), bridge_name(prefix)
    latency_wanted = spec.latency_us > 0
    use_netem = False
    try:
        _run(["ip", "netns", "add", hub], f"creating namespace {hub}")
        _run(["ip", "-n", hub, "link", "set", "lo", "up"], f"bringing up lo in {hub}")
        # STP is off by default, so ports forward at once (no 15 s listening/learning delay)
        _run(["ip", "-n", hub, "link", "add", bridge, "type", "bridge"], f"creating bridge {bridge} in {hub}")
        _run(["ip", "-n", hub, "link", "set", bridge, "up"], f"bringing up {bridge} in {hub}")
        for rank in range(spec.workers):
            namespace, link = worker_namespace(prefix, rank), hub_link_name(prefix, rank)
            _run(["ip", "netns", "add", namespace], f"creating namespace {namespace}")
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"], f"bringing up lo in {namespace}")
            # both ends are born inside their namespaces: nothing appears in the host's namespace,
            # and "eth0" cannot clash with the host's own interfaces
            _run(["ip", "link", "add", link, "netns", hub, "type", "veth", "peer", "name", WORKER_INTERFACE,
                  "netns", namespace], f"creating the veth pair {link}/{WORKER_INTERFACE} for {namespace}")
            _run(["ip", "-n", hub, "link", "set", link, "master", bridge], f"attaching {link} to {bridge}")
            _run(["ip", "-n", hub, "link", "set", link, "up"], f"bringing up {link} in {hub}")
            _run(["ip", "-n", namespace, "addr", "add", f"{worker_address(rank)}/{SUBNET_BITS}", "dev",
                  WORKER_INTERFACE], f"addressing {WORKER_INTERFACE} in {namespace}")
            _run(["ip", "-n", namespace, "link", "set", WORKER_INTERFACE, "up"],
                 f"bringing up {WORKER_INTERFACE} in {namespace}")
            if rank == 0 and latency_wanted:
                use_netem = _netem_available(namespace, WORKER_INTERFACE)
                if not use_netem:
                    warnings.warn(f"this kernel has no tc netem (CONFIG_NET_SCH_NETEM); latency={spec.latency!r} is "
                                  f"not emulated, only bandwidth={spec.bandwidth!r}", RuntimeWarning, stacklevel=2)
            _shape(namespace, WORKER_INTERFACE, spec, use_netem)  # what the worker sends
            _shape(hub, link, spec, use_netem)  # what the worker receives
    except BaseException:  # KeyboardInterrupt half-way included: leave nothing behind
        try:
            down(prefix)
        except ClusterError as cleanup_error:
            warnings.warn(f"cleanup after a failed `up` failed too: {cleanup_error}", RuntimeWarning, stacklevel=2)
        raise
    return Cluster(spec=spec, latency_emulated=use_netem)


def down(prefix: str = "gw") -> list[str]:
    """Delete every namespace named ``{prefix}-hub`` or ``{prefix}-w<N>``; return the names deleted.

    Deleting a namespace deletes the interfaces inside it (the bridge, both veth ends), so no
    interface is touched by name and none outside these namespaces at all. Safe when nothing
    exists. Processes still running inside a namespace keep its network alive, unnamed, until
    they exit: stop the workers before calling this (a warning lists their pids).
    """
    if not PREFIX_PATTERN.fullmatch(str(prefix)):
        raise ValueError(f"prefix={prefix!r} is not supported; allowed: a lowercase letter followed by at most 9 "
                         f"lowercase letters or digits")
    if _tool("ip") is None:
        return []  # without iproute2 nothing can have been created
    deleted = []
    lingering: dict[str, list[str]] = {}
    # workers first: the hub goes last so the bridge outlives every link attached to it
    for namespace in reversed(list_namespaces(prefix)):
        try:
            pids = _run(["ip", "netns", "pids", namespace], f"listing processes in {namespace}").split()
        except ClusterError:
            pids = []
        if pids:
            lingering[namespace] = pids
        try:
            _run(["ip", "netns", "delete", namespace], f"deleting namespace {namespace}")
        except ClusterError:
            if namespace in list_namespaces(prefix):  # gone meanwhile (a concurrent down) is fine
                raise
            continue
        deleted.append(namespace)
    if lingering:
        listed = "; ".join(f"{name}: {' '.join(pids)}" for name, pids in lingering.items())
        warnings.warn(f"processes were still running in deleted namespaces ({listed}); their links disappear only "
                      f"when they exit", RuntimeWarning, stacklevel=2)
    return deleted
