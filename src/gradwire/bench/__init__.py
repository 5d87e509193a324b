"""Benchmarks behind ``gradwire bench ...``: each prints a table and can write JSON."""
