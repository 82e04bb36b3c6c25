"""The operator REST API (FastAPI). Build it with :func:`create_app`; nothing runs at import."""

from app.api.app import create_app
from app.api.auth import ApiConfigError

__all__ = ["ApiConfigError", "create_app"]
