"""The process that runs a session's user code (see `main`)."""
