"""``python -m relgen.bench [options]``: the same as ``relgen bench [options]``."""

import sys

from relgen.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
