"""``python -m kvgates``: the ``kvgates`` command (``kvgates.cli``), for an environment whose scripts folder is not on
``PATH``."""

import sys

from kvgates.cli import main

sys.exit(main())
