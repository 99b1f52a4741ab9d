"""Alembic revisions of the registry's index DB."""
