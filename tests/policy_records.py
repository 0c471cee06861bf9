"""Build DHT records for policy tests, without a network."""

from p2pfusion.dht.records import PeerRecord, PeerState


def rec(start, end, state=PeerState.ONLINE, throughput=1.0, name=None, network=None, **extra):
    """A record whose peer carries `throughput` tokens/s through its whole span."""
    return PeerRecord(
        "m", name or f"p{start}x{end}x{throughput:g}{state.value}".replace(".", "d"), [], start, end, state,
        compute_rate=throughput * (end - start), network_rate=network, device="cpu", **extra,
    )
