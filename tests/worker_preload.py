"""What the test workers' fork server loads once (``tests/distributed.py``), so that every worker
forked from it starts with it done: torch's import (about 1.5 s per process on 2 cores), gradwire's,
and numba's start-up at the first native kernel call (about 0.5 s; later kernels load from the
cache in milliseconds). Nothing here starts a thread or a process group.
"""

import numpy as np
import torch  # noqa: F401
import torch.distributed  # noqa: F401

import gradwire  # noqa: F401
from gradwire import kernels

if kernels.available():
    kernels.divide_and_hash(np.ones(64, dtype=np.float32), 1.0)
    # the worker decides for itself from its own environment (GRADWIRE_NATIVE), as a spawned one would
    kernels._tried, kernels._compiled = False, None
