"""Accelerator kernels for moefast, installed as ``moefast.kernels``.

Each kernel ships with a pure-JAX reference of the same semantics. This package imports only JAX:
it never imports ``moefast``, so kernels can be tested and reused on their own.

The folder is ``kernels/`` at the checkout's root (the project's layout), so a Python session,
notebook or script started there finds it as a top-level ``kernels`` before Hugging Face's
``kernels`` distribution (which transformers imports on its own). Imported under that name, this
file hands the name to the first other ``kernels`` on ``sys.path``; when there is none it stays an
empty module without a file or contents, as Python makes a bare namespace folder (so availability
checks such as transformers' ``is_kernels_available`` say no, and ``from kernels import X`` fails
as for any missing name): the folder is only ever ``moefast.kernels``.
"""

if __name__ == "kernels":  # found through the checkout's root on sys.path, not installed as moefast.kernels
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:  # nothing else named kernels: look like a bare namespace folder (no file, no contents)
        __file__ = None
        __path__[:] = []
        del importlib, os, sys, _root, _spec
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
        _spec.loader.exec_module(_module)
