"""``python -m vramplan`` runs the command line."""

import sys

from vramplan.cli import main

sys.exit(main())
