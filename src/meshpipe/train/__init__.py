"""meshpipe.train."""
