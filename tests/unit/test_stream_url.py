"""The stream URL: one node or a cluster's, as the AMQP URL lists them."""

from __future__ import annotations

import pytest

from app.streams.endpoint import StreamEndpoint


def test_one_node_with_defaults() -> None:
    ep = StreamEndpoint.parse("rabbitmq-stream://rabbit/")
    assert ep.addresses == (("rabbit", 5552),)
    assert (ep.username, ep.password, ep.vhost) == ("guest", "guest", "/")


def test_a_clusters_nodes_in_order_with_credentials_and_vhost() -> None:
    ep = StreamEndpoint.parse("rabbitmq-stream://out%40box:p%3Ass:w@n1:4781,n2,[::1]:4783/prod%2Fa")
    assert ep.addresses == (("n1", 4781), ("n2", 5552), ("::1", 4783))
    assert (ep.host, ep.port) == ("n1", 4781)
    assert ep.username == "out@box"
    assert ep.password == "p:ss:w"
    assert ep.vhost == "prod/a"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("amqp://rabbit/", "starts rabbitmq-stream://"),
        ("rabbitmq-stream+tls://rabbit/", "starts rabbitmq-stream://"),
        ("rabbitmq-stream://rabbit:port/", "host:port pairs"),
        ("rabbitmq-stream://rabbit:70000/", "host:port pairs"),
        ("rabbitmq-stream://a:1,,b:2/", "host:port pairs"),
    ],
)
def test_a_bad_url_says_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StreamEndpoint.parse(url)
