"""``python -m meshpipe``: the command line (see ``meshpipe.cli``)."""

import sys

from meshpipe.cli import main

sys.exit(main())
