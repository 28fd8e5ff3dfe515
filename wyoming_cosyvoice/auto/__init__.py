"""The auto profile: this machine's measured stage costs and the choice of a profile per
request."""
