"""Django's PostgreSQL backend, with a health check that costs no round trip while the server
has nothing to say (``base.DatabaseWrapper.is_usable``), and prepared statements where a caller
asks for one (``base.DatabaseWrapper.get_connection_params``)."""
