"""Benchmarks behind ``moefast bench ...``: speed and memory targets live here, not in unit tests."""
