"""Prefect's temporary server, started by one process at a time per SQLite database."""

from __future__ import annotations

from pathlib import Path

from alignflow.flows.store.artifacts import exclusive_lock


def sqlite_database() -> Path | None:
    """The SQLite file a temporary Prefect server of this process would use; None when it would start none
    (PREFECT_API_URL is set, or the temporary server is off) or its database is not a file."""
    from prefect.settings import get_current_settings
    from sqlalchemy.engine import make_url

    settings = get_current_settings()
    url = settings.server.database.connection_url
    if settings.api.url or not settings.server.ephemeral.enabled or url is None:
        return None
    url = make_url(url.get_secret_value())
    if url.get_backend_name() != "sqlite" or not url.database or "memory" in url.database:
        return None
    return Path(url.database)


def start_temporary_server() -> None:
    """Start Prefect's temporary server for this process now, if it would start one, holding a lock beside its
    database until the server answers.

    Each temporary server migrates its database as it starts, and Prefect guards that only within a process
    (a threading lock around alembic). Two runs starting at once on one PREFECT_HOME (or a run beside another
    user's on ~/.prefect) raced the same migrations: "duplicate column name", "index ... already exists",
    "Online migration expected to match one row". The server quit at startup, and Prefect took its exit code 3
    for a busy port and started it again.
    The server is healthy only once migrated, so the next one waits here and finds the schema current."""
    db = sqlite_database()
    if db is None:
        return
    from prefect.server.api.server import SubprocessASGIServer

    with exclusive_lock(db.with_name(db.name + ".start.lock")):
        SubprocessASGIServer().start()  # the instance Prefect's client takes (`get_client`): it starts none again
