"""Shipped experiment configs (YAML), installed as ``moefast.configs``; ``tiny.yaml`` is the default."""
