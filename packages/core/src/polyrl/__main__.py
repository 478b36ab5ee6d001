"""``python -m polyrl`` runs the CLI."""

import sys

from polyrl.cli import main

sys.exit(main())
