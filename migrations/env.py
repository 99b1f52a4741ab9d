"""Alembic's entry point: runs revisions on the connection flare hands it."""

from __future__ import annotations

from alembic import context

from flare.registry.models import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
