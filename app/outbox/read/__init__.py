"""The outbox's read side: what operators and monitors read, a module per topic, each named for
the readers that use it.

Nothing here changes a row (state changes live in the store, the registry, the operators'
actions and retention: see :mod:`app.outbox.database`). Every function takes the engine (or a
connection) and the current time as keyword arguments and returns plain frozen dataclasses, so
the REST API, the console and the CLI share them. Each works on PostgreSQL and on SQLite;
percentiles are computed in Python from a bounded select for that reason.

Which reader uses which module:

- ``stats``: the outbox's figures (counts, ages, confirm latency, publishers, table upkeep) for
  ``GET /v1/stats``, ``outbox status`` and the console's overview; :mod:`app.outbox.health`
  judges them.
- ``metrics``: the API's ``/metrics`` (:mod:`app.api.metrics`), from the same queries.
- ``outstanding``: in-flight rows (``GET /v1/confirms/outstanding``, ``outbox outstanding``,
  the console's outstanding page).
- ``batches``: Spark batches (``/v1/batches``, ``outbox batches``, the console's batches).
- ``messages``: one message, its events, a page of messages (``/v1/messages``,
  ``outbox message``, the console's messages pages).
- ``scopes``: the SQL of a :class:`~app.outbox.scope.Scope` and its bounds, one definition for
  searches, counts, failures and the republish of :mod:`app.outbox.actions`.
- ``failures``: terminal failures by cause (``/v1/failures``, ``outbox failures``, the
  console's failures page).
- ``keys``: ordering keys parked behind a failure (``/v1/keys/parked``, ``outbox parked``, the
  console).
- ``audit`` and ``rejects``: the operators' audit log and the Spark writer's rejects (REST, CLI
  and console alike).
- ``rates``: the console overview's rows per minute, from the publishers' samples.
- ``cursors`` and ``figures``: pure helpers (cursors and pages; ages and percentiles), standard
  library only.
- ``sql``: the pieces of SQL more than one module here uses.

Import the module you read from (``from app.outbox.read.batches import list_batches``): this
package re-exports nothing.
"""
