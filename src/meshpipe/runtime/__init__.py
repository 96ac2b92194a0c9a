"""meshpipe.runtime."""
