"""Benchmarks behind ``moefast bench ...``: speed and memory targets live here, not in unit tests.

They share one core, :mod:`moefast.bench.process` (``moefast train`` processes, timed compiled
steps, results written as JSON + markdown). The comparison with Hugging Face transformers, which
needs torch, is a development script outside the package: ``python benchmarks/peers.py``.
"""
