"""`python -m trl_padfree.cli`: the `trl-padfree` command."""

import sys

from . import main

sys.exit(main())
