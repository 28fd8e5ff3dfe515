"""The Wyoming front end: the listener, one handler per connection, the event reader with its
limits, the mDNS advertisement."""
