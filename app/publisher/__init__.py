"""The publisher service (``outbox publish``): drains the outbox into RabbitMQ with confirms.

- :mod:`app.publisher.service`: ``run_publisher`` (the async entry point of the CLI, the demo and
  the benchmark) and ``main`` (SIGTERM/SIGINT mapped to a graceful stop);
- :mod:`app.publisher.engine`: the :class:`~app.publisher.engine.Publisher` and its parts.

The package itself imports nothing: the pure parts (settlement, holdings, envelopes,
destinations, outcomes) load without the I/O stacks.
"""
