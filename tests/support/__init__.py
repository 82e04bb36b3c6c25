"""The suite's shared helpers. Test modules import from here, never from one another.

- :mod:`~tests.support.factories`: outbox rows and databases for a test;
- :mod:`~tests.support.outbox_clients`: the outbox's clients on one database, as the product
  builds them;
- :mod:`~tests.support.publisher`: a publisher run against the real broker, its settings, and
  waits for rows and messages;
- :mod:`~tests.support.consumer`: the consumer kit's harness;
- :mod:`~tests.support.fakebroker`: a scripted AMQP broker, for what a real one cannot be made to
  do (always in addition to the real-broker test);
- :mod:`~tests.support.cluster`: the three-node RabbitMQ cluster;
- :mod:`~tests.support.large_outbox`: the million-row outbox and the plans read from it;
- :mod:`~tests.support.dbview`: what a Spark test reads back from the outbox;
- :mod:`~tests.support.api`, :mod:`~tests.support.console`, :mod:`~tests.support.cli`,
  :mod:`~tests.support.spark`: the seeded outbox, tokens, clients and fixtures that several
  API, console, CLI and Spark test modules share;
- :mod:`~tests.support.env`: the repository, the services, the scrubbed environment.

The conformance suite's schedule generator and model stay in ``tests/conformance/``, the consumer
kit's model in ``tests/unit/consumer_model.py``: each is the machinery of one suite.
"""
