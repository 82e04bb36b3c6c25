"""Commands that run something: migrate, publish, serve, consume, declare, demo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    Failure,
    Sub,
    UsageError,
    bounded_int,
    json_flag,
    metrics_flags,
    positive_seconds,
    print_json,
)
from app.db import SchemaMismatch, check_schema, head_revision, migrate
from app.hosts import is_loopback
from app.logs import redact
from app.outbox.database import OutboxError
from app.settings import Settings


def _cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    migrate(settings.database_url.get_secret_value(), args.revision)
    if args.json:
        print_json({"revision": args.revision, "head": head_revision()})
        return EXIT_OK
    print(f"outbox schema at revision {args.revision}")
    return EXIT_OK


def _cmd_publish(settings: Settings, args: argparse.Namespace) -> int:
    from app.publisher.service import main as run_publisher_main  # lazy: the CLI imports without it

    try:
        stats = run_publisher_main(settings, until_empty=args.until_empty)
    except SchemaMismatch as exc:
        raise Failure(str(exc)) from None
    except OutboxError as exc:  # e.g. another publisher holds this SQLite outbox
        raise Failure(str(exc)) from None
    if not args.until_empty:
        return EXIT_OK
    print(
        f"outbox publish: drained: {stats.confirmed} confirmed, {stats.failed} failed, "
        f"{stats.returned} returned, {stats.nacked_final} nacked, {stats.lost} possible "
        f"duplicates in {stats.elapsed_seconds:.1f}s"
    )
    if stats.ended_badly:
        print(
            f"outbox publish: {stats.ended_badly} rows ended failed, returned or nacked: "
            "see `outbox failures`",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from app.api import ApiConfigError, create_app

    host = args.host or settings.api_host
    port = args.port or settings.api_port
    if args.insecure or settings.api_insecure:  # one rule, whichever way it is switched on
        if not is_loopback(host):
            raise UsageError(
                f"insecure mode (--insecure / OUTBOX_API_INSECURE) serves on loopback addresses "
                f"only, not {host}"
            )
        settings = settings.model_copy(update={"api_insecure": True})
        print("outbox: serving WITHOUT authentication (insecure local mode)", file=sys.stderr)
    cert = args.tls_cert or settings.api_tls_cert
    key = args.tls_key or settings.api_tls_key
    if (cert is None) != (key is None):
        raise UsageError("TLS needs both --tls-cert and --tls-key (OUTBOX_API_TLS_CERT/_KEY)")
    for what, path in (("certificate", cert), ("key", key)):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"TLS {what} {path} is not a readable file")
    if cert is None and not is_loopback(host):
        print(
            f"outbox: serving plain HTTP on {host}: bearer tokens cross the network in clear; "
            "use --tls-cert/--tls-key or a TLS-terminating proxy (docs/security.md)",
            file=sys.stderr,
        )
    try:
        app = create_app(settings)
    except ApiConfigError as exc:
        raise UsageError(str(exc)) from None
    # explicit: uvicorn's default trusts X-Forwarded-For from 127.0.0.1 (any local process,
    # or a forged header through a local proxy, would choose the audited and throttled address)
    proxies = args.forwarded_allow_ips or settings.api_forwarded_allow_ips or ""
    # log_config=None: uvicorn's access and error lines go to our handler (text or JSON, redacted)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        ssl_certfile=cert,
        ssl_keyfile=key,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies,
        log_config=None,
    )
    return EXIT_OK


def _cmd_consume(settings: Settings, args: argparse.Namespace) -> int:
    """Run the consumer kit on QUEUE (or --stream) with the handler MODULE:FUNCTION until
    SIGTERM/SIGINT."""
    import asyncio

    from app.consumer import consumer_engine

    if (args.queue is None) == (args.stream is None):
        raise UsageError("name a QUEUE or a --stream (one of them)")
    if args.stream is not None and args.dead_letter_exchange is not None:
        raise UsageError(
            "a stream has no dead letters: a message past --delivery-limit is kept in "
            "outbox_consumer_attempts and skipped (docs/consumer.md, Streams)"
        )
    handler = _load_handler(args.handler)
    config = _consumer_config(settings, args)
    engine = consumer_engine(
        settings.database_url.get_secret_value(), concurrency=config.concurrency
    )
    check_schema(engine)
    try:
        asyncio.run(_consume(settings, args, config, engine, handler))
    finally:
        engine.dispose()
    return EXIT_OK


def _load_handler(given: str) -> Any:
    """The handler ``MODULE:FUNCTION``; a usage error naming it when it cannot be loaded."""
    import importlib

    module_name, _, attr = given.partition(":")
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"cannot load handler {given!r}: {exc}") from None
    if not callable(handler):
        raise UsageError(f"handler {given!r} is not callable")
    return handler


def _consumer_config(settings: Settings, args: argparse.Namespace) -> Any:
    """The kit's config: each flag given, else its setting."""
    from app.consumer import ConsumerConfig

    source = args.queue or args.stream
    return ConsumerConfig(
        name=args.name or source,
        queue=source,
        mode=args.mode or settings.consumer_mode,
        prefetch=args.prefetch or settings.consumer_prefetch,
        concurrency=args.concurrency or settings.consumer_concurrency,
        batch_size=args.batch_size or settings.consumer_batch_size,
        delivery_limit=args.delivery_limit or settings.consumer_delivery_limit,
        handler_timeout=args.handler_timeout or settings.consumer_handler_timeout,
        dead_letter_exchange=args.dead_letter_exchange,
        dead_letter_routing_key=args.dead_letter_routing_key,
    )


async def _consume(
    settings: Settings, args: argparse.Namespace, config: Any, engine: Any, handler: Any
) -> None:
    """The kit until SIGTERM or SIGINT, with its probes when a metrics port is given."""
    import asyncio
    import signal

    from app.consumer import Consumer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    given = {"batch_handler" if args.batches else "handler": handler}
    consumer: Any
    if args.stream is not None:
        from app.consumer import StreamConsumer
        from app.streams.endpoint import stream_url_of

        consumer = StreamConsumer(
            config=config, stream_url=stream_url_of(settings), engine=engine, **given
        )
    else:
        consumer = Consumer(
            config=config, amqp_url=settings.amqp_url.get_secret_value(), engine=engine, **given
        )
    probes = None
    if args.metrics_port is not None:  # /metrics, /healthz, /readyz of this process
        probes = _consumer_probes(consumer, config.name, args)
        await probes.start()
        print(f"outbox consume: metrics on {probes.url}/metrics", file=sys.stderr)
    try:
        await consumer.run(stop)
    finally:
        if probes is not None:
            await probes.close()


def _consumer_probes(consumer: Any, name: str, args: argparse.Namespace) -> Any:
    from app.consumer import registry_for
    from app.probes import ProbeServer, check_route, metrics_route

    def alive() -> tuple[bool, dict[str, object]]:
        return True, {"consumer": name}

    return ProbeServer(
        {
            "/metrics": metrics_route(registry_for(consumer.metrics, consumer=name)),
            "/healthz": check_route(alive),
            "/readyz": check_route(consumer.ready),
        },
        host=args.metrics_host,
        port=args.metrics_port,
    )


def _cmd_declare(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from app.amqp.errors import ChannelClosedError, WireError

    exchange_work, stream_args = _declare_checked(args)
    url = settings.amqp_url.get_secret_value()
    try:
        done = asyncio.run(exchange_work(url)) if exchange_work is not None else None
        streams = asyncio.run(_declare_streams(url, args.stream, stream_args))
    except ChannelClosedError as exc:
        raise Failure(f"the broker refused: {exc.reason}") from None
    except (WireError, TimeoutError) as exc:
        raise Failure(f"broker: {redact(str(exc)) or type(exc).__name__}") from None
    if args.json:
        shown: dict[str, Any] = dataclasses.asdict(done) if done is not None else {}
        if streams:
            shown["streams"] = [dataclasses.asdict(s) for s in streams]
        print_json(shown)
        return EXIT_OK
    if done is not None:
        _print_declared(done)
    for stream in streams:
        retention = ", ".join(f"{k}={v}" for k, v in stream.arguments.items()) or "no retention"
        print(f"stream {stream.stream!r} (durable, {retention}) is declared")
    return EXIT_OK


def _declare_checked(args: argparse.Namespace) -> tuple[Any, Any]:
    """The command line checked before anything reaches the broker: the exchange's declaration
    (a coroutine function of the URL, None without an exchange) and the streams' arguments."""
    import functools

    from app.topology import declare, queue_arguments, stream_arguments

    if args.exchange is None and (args.queue or args.bind):
        raise UsageError("--queue and --bind need an EXCHANGE (the queue is bound to it)")
    if args.bind and args.queue is None:
        raise UsageError("--bind needs --queue (the queue to bind)")
    given = {
        "max_length_bytes": args.max_length_bytes,
        "max_age": args.max_age,
        "max_segment_size_bytes": args.stream_max_segment_size_bytes,
        "initial_cluster_size": args.initial_cluster_size,
    }
    if not args.stream and any(v is not None for v in given.values()):
        raise UsageError(
            "--max-length-bytes, --max-age, --stream-max-segment-size-bytes and "
            "--initial-cluster-size are a --stream's"
        )
    if args.exchange is None and not args.stream:
        raise UsageError("name an EXCHANGE, or a --stream, or both")
    try:
        queue_arguments(args.queue_type, delivery_limit=args.delivery_limit)
        stream_args = stream_arguments(**given)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.exchange is None:
        return None, stream_args
    work = functools.partial(
        declare,
        exchange=args.exchange,
        kind=args.type,
        queue=args.queue,
        bindings=args.bind or (),
        queue_type=args.queue_type,
        delivery_limit=args.delivery_limit,
    )
    return work, stream_args


async def _declare_streams(url: str, names: list[str] | None, arguments: Any) -> list[Any]:
    from app.topology import declare_streams

    if not names:
        return []
    return await declare_streams(url, streams=names, arguments=arguments)


def _print_declared(done: Any) -> None:
    print(f"exchange {done.exchange!r} ({done.kind}, durable) is declared")
    if done.queue is not None:
        keys = ", ".join(repr(k) for k in done.bindings)
        limit = f", delivery limit {done.delivery_limit}" if done.delivery_limit else ""
        print(
            f"queue {done.queue!r} ({done.queue_type}, durable{limit}) is bound to it with "
            f"{keys}; it holds {done.queue_messages} messages"
        )


def _cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from app.demo import main as demo_main  # lazy: Spark is an optional extra

    return demo_main(settings, rows=args.rows, files=args.files, workdir=args.workdir)


def _add_migrate(sub: Sub) -> None:
    mig = sub.add_parser("migrate", help="create or upgrade the outbox schema")
    mig.add_argument("--revision", default="head", help="target alembic revision (default head)")
    json_flag(mig, what="the revision reached, as JSON")
    mig.set_defaults(func=_cmd_migrate)


def _add_publish(sub: Sub) -> None:
    pub = sub.add_parser(
        "publish",
        help="run a publisher: outbox rows to RabbitMQ with publisher confirms",
        description="Run a publisher until SIGINT/SIGTERM, then settle and stop. With "
        "--until-empty, stop once no row is in flight and none is due within backoff_max "
        "(a cron or Airflow task): exit 0, or 1 when rows of this run ended failed, returned "
        "or nacked.",
    )
    pub.add_argument(
        "--until-empty",
        action="store_true",
        help="stop once the outbox is drained; exit 1 if rows ended failed, returned or nacked",
    )
    pub.set_defaults(func=_cmd_publish)


def _add_serve(sub: Sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve the REST API (uvicorn)",
        description="Serve the operator REST API. Needs OUTBOX_API_TOKEN and/or "
        "OUTBOX_OPERATOR_TOKEN, or --insecure on a loopback address.",
    )
    srv.add_argument("--host", help="address to bind (default OUTBOX_API_HOST, 127.0.0.1)")
    srv.add_argument(
        "--port", type=bounded_int(1, 65535), help="port (default OUTBOX_API_PORT, 8080)"
    )
    srv.add_argument(
        "--insecure", action="store_true", help="allow serving without tokens (loopback only)"
    )
    srv.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    srv.add_argument("--tls-key", help="the certificate's private key (PEM)")
    srv.add_argument(
        "--forwarded-allow-ips",
        metavar="ADDRESSES",
        help="trust X-Forwarded-For/-Proto from these proxies only (comma-separated IPs or "
        "networks; default OUTBOX_API_FORWARDED_ALLOW_IPS, none)",
    )
    srv.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    srv.set_defaults(func=_cmd_serve)


def _add_consume(sub: Sub) -> None:
    con = sub.add_parser(
        "consume",
        help="consume a queue with the idempotent consumer kit (manual acks, prefetch, inbox)",
        description="Each message's effect happens once: the handler runs in a database "
        "transaction with the inbox row, then the delivery is acknowledged; a redelivery or a "
        "duplicate publish is acknowledged without running it again. With --stream, a RabbitMQ "
        "stream is read in order from the position stored on the broker under --name (first "
        "run: its first offset), with the same inbox; the position is stored after the commits.",
    )
    con.add_argument("queue", nargs="?", help="the queue to consume (it must exist)")
    con.add_argument(
        "--stream",
        metavar="NAME",
        help="read this stream instead of a queue (OUTBOX_STREAM_URL's broker)",
    )
    con.add_argument(
        "--handler", required=True, help="MODULE:FUNCTION taking (message, connection)"
    )
    con.add_argument(
        "--batches",
        action="store_true",
        help="the handler takes (messages, connection): a window's messages at once",
    )
    con.add_argument(
        "--name",
        help="consumer name, the inbox key and a stream's stored position (default: the queue "
        "or stream)",
    )
    _consume_tuning(con)
    _consume_outlets(con)
    con.set_defaults(func=_cmd_consume)


def _consume_tuning(con: argparse.ArgumentParser) -> None:
    """The kit's tuning flags; each defaults to its OUTBOX_CONSUMER_* setting."""
    con.add_argument(
        "--prefetch",
        type=bounded_int(1, 65535),
        default=None,
        help="unacked deliveries held at once (default OUTBOX_CONSUMER_PREFETCH, 400)",
    )
    con.add_argument(
        "--mode",
        choices=("batch", "message"),
        default=None,
        help="batch: windows of deliveries per transaction (effects in the database); message: "
        "a transaction per message (effects outside it) (default OUTBOX_CONSUMER_MODE, batch)",
    )
    con.add_argument(
        "--concurrency",
        type=bounded_int(1, 256),
        default=None,
        help="handler threads (default OUTBOX_CONSUMER_CONCURRENCY, 8)",
    )
    con.add_argument(
        "--batch-size",
        type=bounded_int(1, 10000),
        default=None,
        help="batch mode: deliveries per transaction at most (default "
        "OUTBOX_CONSUMER_BATCH_SIZE, 200)",
    )
    con.add_argument(
        "--delivery-limit",
        type=bounded_int(1, 1000),
        default=None,
        help="attempts (failures, timeouts, crashes) before a message is "
        "dead-lettered (default OUTBOX_CONSUMER_DELIVERY_LIMIT, 5)",
    )
    con.add_argument(
        "--handler-timeout",
        type=positive_seconds,
        default=None,
        help="seconds a handler may run before its attempt fails (default "
        "OUTBOX_CONSUMER_HANDLER_TIMEOUT, 60)",
    )


def _consume_outlets(con: argparse.ArgumentParser) -> None:
    """Where dead letters and the kit's metrics go."""
    con.add_argument(
        "--dead-letter-exchange",
        default=None,
        help="publish dead letters here with headers saying why ('' is the default exchange), "
        "then ack them; without it they are rejected (the queue's x-dead-letter-exchange)",
    )
    con.add_argument(
        "--dead-letter-routing-key",
        default=None,
        help="routing key for --dead-letter-exchange (default: the message's)",
    )
    metrics_flags(con)


def _add_declare(sub: Sub) -> None:
    dec = sub.add_parser(
        "declare",
        help="declare the exchange rows go to (and a queue bound to it), or streams: durable, "
        "idempotent",
        description="Declare EXCHANGE, durable, on OUTBOX_AMQP_URL's broker; with --queue also "
        "a durable queue bound to it. Rows for an exchange that does not exist end 'failed' "
        "(404 NOT_FOUND) once their retries are spent. With --stream, declare streams (rows "
        "naming a stream) with their retention. Declaring what exists with the same type and "
        "arguments changes nothing; other arguments are refused (406 PRECONDITION_FAILED).",
    )
    dec.add_argument("exchange", nargs="?", help="the exchange (optional with --stream)")
    dec.add_argument(
        "--type",
        default="topic",
        choices=["direct", "topic", "fanout", "headers"],
        help="exchange type (default topic)",
    )
    dec.add_argument("--queue", help="also declare this queue and bind it")
    dec.add_argument(
        "--queue-type",
        default="classic",
        choices=["classic", "quorum"],
        help="classic (default; one node) or quorum (replicated on a cluster: "
        "a confirm means a majority wrote it)",
    )
    dec.add_argument(
        "--delivery-limit",
        type=int,
        metavar="N",
        help="quorum only: x-delivery-limit, the broker dead-letters (or drops) a "
        "message after N returns",
    )
    dec.add_argument(
        "--bind",
        action="append",
        metavar="KEY",
        help="binding key, repeatable (default '#' for topic, '' else)",
    )
    _declare_stream_flags(dec)
    json_flag(dec, what="what was declared, as JSON")
    dec.set_defaults(func=_cmd_declare)


def _size(text: str) -> int:
    from app.topology import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _declare_stream_flags(dec: argparse.ArgumentParser) -> None:
    """A stream's name and retention (RabbitMQ's x-max-length-bytes, x-max-age,
    x-stream-max-segment-size-bytes) and replication (x-initial-cluster-size)."""
    dec.add_argument(
        "--stream",
        action="append",
        metavar="NAME",
        help="declare this stream (x-queue-type stream), repeatable; the retention flags "
        "apply to each",
    )
    dec.add_argument(
        "--max-length-bytes",
        type=_size,
        metavar="SIZE",
        help="a stream's retention by size: past it, its oldest segments are deleted "
        "(bytes, or 500MB, 20GB)",
    )
    dec.add_argument(
        "--max-age",
        metavar="AGE",
        help="a stream's retention by age: segments whose messages are all older are deleted "
        "(a count and a unit: Y M D h m s, e.g. 7D, 24h)",
    )
    dec.add_argument(
        "--stream-max-segment-size-bytes",
        type=_size,
        metavar="SIZE",
        help="a stream's segment files' size (RabbitMQ's default 500MB): retention deletes "
        "whole segments",
    )
    dec.add_argument(
        "--initial-cluster-size",
        type=int,
        metavar="N",
        help="on a cluster, the nodes that hold each stream (its leader and replicas)",
    )


def _add_demo(sub: Sub) -> None:
    dem = sub.add_parser(
        "demo", help="the main job end to end: Spark -> outbox -> RabbitMQ, verified"
    )
    dem.add_argument("--rows", type=bounded_int(1, 10_000_000), default=20_000)
    dem.add_argument("--files", type=bounded_int(1, 1000), default=4, help="micro-batches")
    dem.add_argument("--workdir", type=Path, default=Path("demo-data"))
    dem.set_defaults(func=_cmd_demo)


def _cmd_token(settings: Settings, args: argparse.Namespace) -> int:
    import secrets

    from app.tokens import token_weakness

    while True:  # 32 random bytes never fail the check in practice; the loop makes it certain
        token = secrets.token_urlsafe(32)
        if token_weakness(token) is None:
            print(token)
            return EXIT_OK


def _add_token(sub: Sub) -> None:
    tok = sub.add_parser(
        "token",
        help="print a new API token (OUTBOX_API_TOKEN, OUTBOX_OPERATOR_TOKEN)",
        description="Print a random token of 32 bytes (43 URL-safe characters) that `outbox "
        "serve` accepts. Generate one for each of OUTBOX_API_TOKEN and OUTBOX_OPERATOR_TOKEN.",
    )
    tok.set_defaults(func=_cmd_token)


def register(sub: Sub) -> None:
    """This group's commands (running the parts: migrate, publish, serve, consume, declare,
    demo, token)."""
    _add_migrate(sub)
    _add_publish(sub)
    _add_serve(sub)
    _add_consume(sub)
    _add_declare(sub)
    _add_demo(sub)
    _add_token(sub)
