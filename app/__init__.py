"""Publisher-confirm sink and outbox service."""

__version__ = "0.1.0"
