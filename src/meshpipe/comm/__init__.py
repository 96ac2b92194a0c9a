"""meshpipe.comm."""
