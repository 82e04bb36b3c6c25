"""Settings: one class, read from ``OUTBOX_*`` environment variables, built once and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Secrets that may come from a file instead: ``OUTBOX_<NAME>_FILE`` (a Kubernetes or Docker
#: secret, a systemd credential) holds the value, trailing newlines dropped.
SECRET_FILES = (
    "database_url",
    "amqp_url",
    "stream_url",
    "api_token",
    "operator_token",
    "metrics_token",
)


class Settings(BaseSettings):
    """Every knob of the service. Secrets are ``SecretStr`` so they never print or log."""

    # errors never echo the input: a URL in it may carry a password
    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_", extra="ignore", hide_input_in_errors=True
    )

    database_url: SecretStr = Field(
        default=SecretStr("sqlite:///outbox.db"),
        description="SQLAlchemy URL of the outbox: SQLite file (embedded default) or PostgreSQL.",
    )
    amqp_url: SecretStr = Field(
        default=SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="AMQP URL of the RabbitMQ broker: amqp:// or amqps:// (TLS), several hosts "
        "separated by commas for failover, options cafile, capath, certfile, keyfile, "
        "server_hostname, no_verify_ssl, auth=plain|external (docs/operations.md).",
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for read endpoints: 32 to 512 characters that cannot be "
        "guessed (`outbox token` prints one).",
    )
    operator_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for write (operator) endpoints, also reads: 32 to 512 "
        "characters that cannot be guessed (`outbox token` prints one).",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="Bearer token that reads /metrics and nothing else (for Prometheus: no "
        "message, body or reason); the read and operator tokens read /metrics too.",
    )
    database_url_file: str | None = Field(
        default=None,
        description="A file holding the database URL (a mounted secret, "
        "a systemd credential); instead of OUTBOX_DATABASE_URL.",
    )
    stream_url: SecretStr | None = Field(
        default=None,
        description="RabbitMQ's stream protocol, for rows with a `stream` "
        "(rabbitmq-stream://user:pass@host:5552/vhost; a cluster's nodes comma-separated, "
        "host:port each). Unset: the AMQP URL's first host, user and vhost on port 5552.",
    )
    stream_lanes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Lanes of a stream first seen: each is one producer reference on the broker, "
        "held by one publisher at a time; a row's lane is its id modulo the lanes. Fixed per "
        "stream once set (docs/streams.md).",
    )
    amqp_url_file: str | None = Field(
        default=None, description="A file holding the AMQP URL; instead of OUTBOX_AMQP_URL."
    )
    stream_url_file: str | None = Field(
        default=None, description="A file holding the stream URL; instead of OUTBOX_STREAM_URL."
    )
    api_token_file: str | None = Field(
        default=None, description="A file holding the read token; instead of OUTBOX_API_TOKEN."
    )
    operator_token_file: str | None = Field(
        default=None,
        description="A file holding the operator token; instead of OUTBOX_OPERATOR_TOKEN.",
    )
    metrics_token_file: str | None = Field(
        default=None,
        description="A file holding the metrics token; instead of OUTBOX_METRICS_TOKEN.",
    )
    api_insecure: bool = Field(
        default=False, description="Allow the API to start with no tokens (local use only)."
    )

    publisher_id: str | None = Field(
        default=None, description="Name of this publisher; default host:pid:random."
    )
    claim_batch: int = Field(
        default=2_000, ge=1, le=10_000, description="Rows claimed per statement."
    )
    window: int = Field(
        default=10_000, ge=1, description="Most rows held (claimed, not yet settled) at once."
    )
    channels: int = Field(
        default=1, ge=1, le=64, description="Confirm-mode channels per publisher."
    )
    lease_seconds: float = Field(default=60.0, gt=0, description="Lease on claimed rows.")
    poll_interval: float = Field(default=0.2, gt=0, description="Idle wait between empty claims.")
    flush_interval: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="Wait after an outcome before writing it, so more "
        "gather (0: at once; under load they gather while the previous write-back runs).",
    )
    synchronous_commit: bool = Field(
        default=False,
        description="Write-backs of outcomes wait for the disk (claims always do); off, a "
        "database crash can undo the last ones: those rows are published again, counted.",
    )
    settlement: Literal["rows", "ranges"] = Field(
        default="rows",
        description="How a publisher settles exchange rows: `rows` writes each row's claim and "
        "confirm; `ranges` (PostgreSQL; being built, issue 47: the console's and the API's "
        "counts do not derive statuses from ranges yet, so not for production) leases each "
        "claim as one range and writes only a row's exceptions. Every publisher of one outbox "
        "uses the same. See docs/ranges-build.md.",
    )
    publisher_tracing: bool = Field(
        default=False,
        description="Record one OpenTelemetry PRODUCER span per published batch, from its "
        "publish to the settlement of its last row, linked to each row's traceparent (needs the "
        "`otel` extra and an SDK configured by the process). See docs/applications.md.",
    )
    backoff_base: float = Field(default=0.5, gt=0, description="First retry delay, seconds.")
    backoff_max: float = Field(default=60.0, gt=0, description="Largest retry delay, seconds.")
    destination_retry_budget: int = Field(
        default=5, ge=1, description="Attempts before rows for a missing exchange end failed."
    )
    destination_nack_burst: int = Field(
        default=20,
        ge=1,
        description="Fewest nacks to one exchange, with no ack of it for destination_outage_after, "
        "that make a destination outage (exchange paused, rows kept pending, nack budgets "
        "untouched); fewer are charged to the rows.",
    )
    destination_outage_after: float = Field(
        default=1.0,
        gt=0,
        description="Seconds an exchange must nack and ack nothing before it is judged out; "
        "nacks while it acks other rows are the rows' fault (charged).",
    )
    destination_outage_max_wait: float = Field(
        default=300.0,
        gt=0,
        description="Longest a destination outage keeps its rows waiting without spending their "
        "nack budget, counted from the outage's start; then its nacks are charged.",
    )
    return_grace: float = Field(
        default=10.0,
        ge=0,
        description="Seconds after each (re)connect in which a 312 NO_ROUTE return is retried "
        "with backoff (bindings still being recovered), not ended `returned` (0 = off).",
    )
    confirm_timeout: float = Field(
        default=30.0, gt=0, description="A publish unconfirmed this long means the channel is dead."
    )
    heartbeat: int = Field(default=10, ge=0, description="AMQP heartbeat, seconds (0 = off).")
    reconnect_max_delay: float = Field(default=10.0, gt=0, description="Largest reconnect backoff.")
    shutdown_timeout: float = Field(default=10.0, ge=0, description="Most wait to settle on stop.")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1, description="Largest body accepted (RabbitMQ default max)."
    )
    retention_days: float = Field(default=7.0, gt=0, description="Keep confirmed rows this long.")
    purge_sleep_coef: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="`outbox purge` sleeps this many times as long as each chunk took "
        "(0 = no pause): the purge holds the database at most 1 / (1 + this) of its time, "
        "and takes 1 + this times as long.",
    )
    inbox_retention_days: float = Field(
        default=14.0,
        gt=0,
        description="Keep the consumer kit's inbox rows this long (longer "
        "than any redelivery or republish can come late).",
    )
    consumer_mode: Literal["batch", "message"] = Field(
        default="batch",
        description="`outbox consume`: `batch` handles windows of deliveries in one transaction "
        "each (effects in the database); `message` one transaction per message (effects "
        "outside it). See docs/consumer.md.",
    )
    consumer_prefetch: int = Field(
        default=400, ge=1, le=65535, description="`outbox consume`: the consumer's prefetch."
    )
    consumer_concurrency: int = Field(
        default=8,
        ge=1,
        le=256,
        description="`outbox consume`: handler threads (windows or messages at once).",
    )
    consumer_batch_size: int = Field(
        default=200,
        ge=1,
        le=10000,
        description="`outbox consume`, batched mode: deliveries per transaction at most (and "
        "at most half the prefetch).",
    )
    consumer_delivery_limit: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="`outbox consume`: attempts (failures, timeouts, crashes while the handler "
        "ran) before a message is dead-lettered.",
    )
    consumer_handler_timeout: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="`outbox consume`: seconds a handler may run; past it the attempt fails "
        "and the consumer is not ready until the handler returns.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="Largest headers document (JSON) a row may carry; larger rows end failed.",
    )
    outstanding_after: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="A publish unconfirmed this long gets its channel and tag written to its row.",
    )
    publisher_metrics_host: str = Field(
        default="127.0.0.1", description="Address a publisher serves /metrics, /healthz, /readyz."
    )
    publisher_metrics_port: int = Field(
        default=9600,
        ge=0,
        le=65535,
        description="Port of a publisher's /metrics and probes (0: any free port, logged).",
    )

    # logging (every command)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level of every outbox command."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="Log lines as text or as one JSON object per line."
    )

    # operator surface (REST API, CLI)
    api_host: str = Field(default="127.0.0.1", description="Address `outbox serve` binds.")
    api_port: int = Field(default=8080, ge=1, le=65535, description="Port `outbox serve` binds.")
    publisher_heartbeat_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between a publisher's DB heartbeats; alive within 3 intervals.",
    )
    publisher_sample_interval: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="Seconds between a publisher's samples of its figures (`outbox_samples`: "
        "the console's rates and latency charts, one row per publisher each time).",
    )
    api_tls_cert: str | None = Field(
        default=None, description="`outbox serve` speaks HTTPS with this certificate (PEM)."
    )
    api_tls_key: str | None = Field(default=None, description="The API certificate's key (PEM).")
    api_forwarded_allow_ips: str | None = Field(
        default=None,
        description="`outbox serve` trusts X-Forwarded-For/-Proto only from these "
        "proxy addresses (comma-separated IPs or networks, as uvicorn's --forwarded-allow-ips); "
        "default none: the peer address is the client, for the audit and the throttle.",
    )
    api_docs: bool = Field(
        default=False,
        description="`outbox serve` also serves /docs, /redoc and /openapi.json "
        "(off by default: the Swagger UI and ReDoc pages load scripts from a CDN on the "
        "console's origin, without its Content-Security-Policy).",
    )
    api_max_body_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Largest request body the API reads (413 above it, before any parsing).",
    )
    api_statement_timeout: float = Field(
        default=10.0,
        ge=0,
        le=3600,
        description="Longest a statement of the API's and the console's reads may run, in "
        "seconds (a search, a page, a count): then it is stopped and the request answered "
        "503 saying how to narrow it; 0: no bound. Operator actions are not bounded.",
    )
    api_auth_failures_per_minute: int = Field(
        default=20,
        ge=1,
        description="Failed authentications per client address and minute "
        "before the API answers 429.",
    )
    ui_session_seconds: int = Field(
        default=8 * 3600,
        ge=60,
        le=7 * 24 * 3600,
        description="Lifetime of a web console session (/ui) after sign-in; rotating a token "
        "or the session key ends every session signed with it, signing out ends one.",
    )
    session_secret: SecretStr | None = Field(
        default=None,
        description="Key that signs web console sessions (/ui), at least 32 "
        "characters (`openssl rand -hex 32`); default: a random key generated once and kept in "
        "the database (outbox_secrets), shared by every API replica. Changing it ends every "
        "session.",
    )
    session_secret_file: str | None = Field(
        default=None,
        description="A file holding the session key (a mounted secret), read "
        "when the API starts; instead of OUTBOX_SESSION_SECRET.",
    )
    api_probe_timeout: float = Field(
        default=3.0,
        gt=0,
        description="Most wait of /readyz for the database (the API reads no broker).",
    )
    stats_latency_window: float = Field(
        default=900.0, gt=0, description="Confirms of the last N seconds feed latency percentiles."
    )
    stats_latency_rows: int = Field(
        default=10_000, ge=1, le=1_000_000, description="Most confirms read for the percentiles."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if not url.startswith(("sqlite", "postgresql")):
            raise ValueError("database_url must be a sqlite:// or postgresql:// URL")
        return value

    @field_validator("amqp_url")
    @classmethod
    def _usable_amqp_url(cls, value: SecretStr) -> SecretStr:
        from app.amqp.params import parse_url  # the message never quotes the URL (a password)

        parse_url(value.get_secret_value())
        return value

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """``OUTBOX_<NAME>_FILE`` fills ``<name>`` from the file (then checked like the
        variable); both set is an error, so a forgotten variable cannot win unseen."""
        if not isinstance(data, dict):
            return data
        for name in SECRET_FILES:
            path = data.get(f"{name}_file")
            if path is None:
                continue
            if data.get(name) is not None:
                raise ValueError(
                    f"set OUTBOX_{name.upper()} or OUTBOX_{name.upper()}_FILE, not both"
                )
            data = {**data, name: _read_secret(str(path), f"OUTBOX_{name.upper()}_FILE")}
        return data

    @model_validator(mode="after")
    def _ranges_need_postgres(self) -> Settings:
        if self.settlement == "ranges" and self.is_sqlite:
            raise ValueError(
                "settlement 'ranges' needs PostgreSQL (SQLite has one writer and settles rows)"
            )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.get_secret_value().startswith("sqlite")


def _read_secret(path: str, variable: str) -> str:
    """A secret file's content without its trailing newline; errors name the file, never the
    content."""
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{variable}: cannot read {path}: {type(exc).__name__}") from None
    if not value:
        raise ValueError(f"{variable}: {path} is empty")
    return value
