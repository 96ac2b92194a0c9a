"""meshpipe.models."""
