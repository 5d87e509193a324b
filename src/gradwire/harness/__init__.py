"""The experiment harness: what ``gradwire train`` and the benchmarks run.

The training loop (:mod:`.training`), workloads by name (:mod:`.workloads`: model + data +
loss), compact method specs (:mod:`.methods`), periodic per-rank checkpoints and torchrun
restarts (:mod:`.resume`), packaged data sets (:mod:`.data`, ``datasets/``) and models
(:mod:`.models`). It sits above the library: it imports the front-ends, the library never
imports it (``tests/test_layers.py``).
"""
