"""`mist-ds profile`: measure this machine at the tuner's shapes; the profile database and a cluster config."""
