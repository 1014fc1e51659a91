"""`python -m bestiary ...`, the same as the `bestiary` script."""

import sys

from bestiary.core.cli import main

sys.exit(main())
