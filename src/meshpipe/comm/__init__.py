"""meshpipe.comm: how pipeline messages travel (``wire``), the point-to-point transport
(``p2p``), stages of different sizes (``vtp``) and the CP/EP collectives (``collectives``)."""
