"""``python -m meshpipe``: the command line (see ``meshpipe.cli``)."""

from meshpipe.cli import entry

entry()
