"""p2pfusion: serve and run large language models over a peer-to-peer swarm."""

__version__ = "0.1.0"
