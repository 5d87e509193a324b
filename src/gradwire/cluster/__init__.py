"""An emulated bandwidth-limited cluster on one Linux machine (network namespaces + tc; needs root).

>>> from gradwire.cluster import ClusterSpec, up
>>> # with up(ClusterSpec(workers=4, workers_per_node=2, bandwidth="100mbit")) as cluster:
>>> #     before = cluster.counters()
>>> #     subprocess.Popen(cluster.wrap(0, [sys.executable, "-m", "gradwire.cli.worker"]), env=...)
>>> #     cross_node = [b - a for a, b in zip(before["node_tx_bytes"], cluster.counters()["node_tx_bytes"])]

``down_all()`` (``gradwire cluster down``) removes every recorded cluster whose launcher is gone.
"""

from __future__ import annotations

from .netns import (
    MAX_WORKERS,
    Cluster,
    ClusterError,
    ClusterExistsError,
    ClusterSpec,
    ClusterUnavailableError,
    cluster_available,
    down,
    down_all,
    find,
    status,
    temporary_prefix,
    up,
)

__all__ = [
    "MAX_WORKERS", "Cluster", "ClusterError", "ClusterExistsError", "ClusterSpec", "ClusterUnavailableError",
    "cluster_available", "down", "down_all", "find", "status", "temporary_prefix", "up",
]
