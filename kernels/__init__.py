"""Accelerator kernels for moefast, installed as ``moefast.kernels``.

Each kernel ships with a pure-JAX reference of the same semantics. This package imports only JAX:
it never imports ``moefast``, so kernels can be tested and reused on their own.
"""
