"""``python -m rdmashim``: the ``rdmashim`` command."""

import sys

from rdmashim.cli import main

sys.exit(main())
