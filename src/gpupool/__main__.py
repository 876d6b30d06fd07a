"""``python -m gpupool`` runs the command line (see :mod:`gpupool._commands.cli`)."""

from __future__ import annotations

import sys

from gpupool._commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
