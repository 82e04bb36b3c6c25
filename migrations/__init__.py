"""Alembic migrations of the outbox schema, shipped in the package for ``outbox migrate``."""
