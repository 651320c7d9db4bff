"""``python -m attnlab.cli``: the ``attnlab`` command."""

import sys

from . import main

sys.exit(main())
