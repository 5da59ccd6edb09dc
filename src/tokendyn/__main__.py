"""``python -m tokendyn``: the same entry point as the ``tokendyn`` command."""

import sys

from tokendyn.cli import main

if __name__ == "__main__":
    sys.exit(main())
