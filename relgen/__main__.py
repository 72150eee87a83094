"""`python -m relgen` is the `relgen` command (useful where the package is on PYTHONPATH but not installed)."""

import sys

from relgen.cli.main import main

sys.exit(main())
