import sys

from moefast.cli import main

sys.exit(main())
