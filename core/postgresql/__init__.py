"""Django's PostgreSQL backend, with a health check that costs no round trip while the server
has nothing to say (``base.DatabaseWrapper.is_usable``)."""
