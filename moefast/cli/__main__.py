"""``python -m moefast.cli``: the ``moefast`` command, as ``python -m moefast``."""

import sys

from moefast.cli import main

sys.exit(main())
