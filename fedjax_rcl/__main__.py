"""``python -m fedjax_rcl`` is the ``fedjax-rcl`` command."""

import sys

from fedjax_rcl.cli import main

sys.exit(main())
