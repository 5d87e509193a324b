"""An emulated bandwidth-limited cluster on one Linux machine (network namespaces + tc; needs root).

>>> from gradwire.cluster import ClusterSpec, up
>>> # with up(ClusterSpec(workers=2, bandwidth="100mbit")) as cluster:
>>> #     subprocess.Popen(cluster.wrap(0, [sys.executable, "-m", "gradwire.cli.worker"]), env=...)
"""

from __future__ import annotations

from .netns import (
    Cluster,
    ClusterError,
    ClusterExistsError,
    ClusterSpec,
    ClusterUnavailableError,
    cluster_available,
    down,
    status,
    up,
)

__all__ = [
    "Cluster", "ClusterError", "ClusterExistsError", "ClusterSpec", "ClusterUnavailableError", "cluster_available",
    "down", "status", "up",
]
