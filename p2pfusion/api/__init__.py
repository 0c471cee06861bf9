"""The HTTP front door: an OpenAI-compatible API (and a web page) over one swarm client."""
