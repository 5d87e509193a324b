"""Command-line interface: ``gradwire ...`` or ``python -m gradwire ...``."""
