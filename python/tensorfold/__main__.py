"""`python -m tensorfold` = the `tensorfold` command."""

import sys

from .cli import main

sys.exit(main())
