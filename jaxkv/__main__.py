"""``python -m jaxkv ...`` is the ``jaxkv`` command line."""

import sys

from jaxkv.cli import main

sys.exit(main())
