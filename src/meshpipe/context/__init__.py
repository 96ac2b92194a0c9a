"""meshpipe.context."""
