"""The AMQP 0-9-1 client of the publish hot path, on pamqp's frame codec.

- :mod:`app.amqp.codec`: pure frames in and out (publish encoding, properties, frame reader);
- :mod:`app.amqp.connection`: the asyncio connection, its channels and the broker's callbacks;
- :mod:`app.amqp.params`: URLs to connection parameters;
- :mod:`app.amqp.errors`: the error hierarchy and reply codes.

The package itself imports nothing: import what you use from its modules (the codec and the
errors load without asyncio).
"""
