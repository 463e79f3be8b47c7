"""The throwaway Redis services the suite and benchmarks start: a port someone else takes first
costs a retry, not the run (a CI run once lost its cluster to a port an outgoing connection took)."""

import socket

import pytest

from kvtier.testing.services import RedisServer, free_cluster_port, redis_binary

pytestmark = pytest.mark.redis

needs_redis = pytest.mark.skipif(redis_binary() is None or redis_binary("redis-cli") is None,
                                 reason="redis-server / redis-cli not installed")


@needs_redis
def test_a_taken_port_is_retried_on_a_fresh_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, 0])  # the first pick is taken; 0 makes the second a fresh OS pick

        def pick() -> int:
            port = next(picks)
            if port:
                return port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])

        with RedisServer(pick_port=pick) as srv:
            assert srv.port != busy
            import redis

            assert redis.Redis(port=srv.port).ping()


@needs_redis
def test_a_given_port_that_is_taken_fails_with_the_servers_own_words():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="exited.*(in use|bind|Could not create)"):
            RedisServer(port=taken.getsockname()[1]).start()


def test_cluster_ports_and_their_bus_ports_lie_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(50):
        port = free_cluster_port()
        assert 10000 <= port and port + 10000 < max(low, 21000)

