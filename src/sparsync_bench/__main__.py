"""``python -m sparsync_bench``: the ``sparsync`` command."""

import sys

from sparsync_bench.cli import main

sys.exit(main())
