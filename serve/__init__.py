"""Serve: the host cache and pull, compatibility checks, the runtime, the HTTP API."""
