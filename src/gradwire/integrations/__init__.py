"""gradwire inside the frameworks people train with; each module needs its framework (an extra).

* :mod:`gradwire.integrations.lightning` — ``GradwireDDPStrategy`` (``pip install gradwire[lightning]``)
* :mod:`gradwire.integrations.hf` — ``GradwireCallback`` for ``transformers.Trainer`` (``[hf]``)
* :mod:`gradwire.integrations.accelerate` — ``register`` + per-rank checkpoints (``[accelerate]``)

Each registers the hook on the DDP wrapper the framework builds, saves and restores every
rank's own hook state with the framework's checkpoints, and warns when the hook never ran.
"""
