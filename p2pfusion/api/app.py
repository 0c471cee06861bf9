"""The OpenAI-compatible HTTP API of one swarm client (`p2pfusion api`), and the server it runs on.

One `SwarmLM` serves every request, each in a session of its own: the process holds one swarm
node, one copy of the model's local parts and one record of peers, and uvicorn runs in the same
asyncio loop as the swarm client. Routes: `GET /v1/models` (and `/v1/models/{id}`),
`POST /v1/chat/completions`, `POST /v1/completions` (api/completions.py), plus the web page and
`GET /v1/swarm` (api/web.py). docs/http_api.md describes them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request

from p2pfusion.api import schemas
from p2pfusion.api.completions import Completions
from p2pfusion.api.errors import APIError, install, unknown_model
from p2pfusion.api.guard import APILimits, Guard
from p2pfusion.api.web import add_web, api_key_refused
from p2pfusion.client.route.planner import missing_layers, usable
from p2pfusion.client.generate.swarm_lm import SwarmLM

GRACEFUL_SHUTDOWN = 5.0  # seconds open streams get to end when the server stops


def create_app(lm: SwarmLM, model_names: Sequence[str], limits: APILimits = APILimits()) -> FastAPI:
    """The API of `lm`'s model, known to requests by any of `model_names` (the first is the name
    answers carry; the display name and the swarm key, usually), within `limits` (api/guard.py).
    With API keys, every `/v1` route wants `Authorization: Bearer KEY`, one of them."""
    names = list(model_names)
    app = FastAPI(title="p2pfusion", docs_url=None, redoc_url=None)
    app.state.api_keys = limits.api_keys
    install(app)
    app.add_middleware(Guard, limits=limits)
    completions = Completions(lm, names, limits)
    created = int(time.time())
    router = APIRouter(prefix="/v1", dependencies=[Depends(_authorized)])

    async def card() -> schemas.ModelCard:
        core = lm.model.core
        total = core.num_layers
        online = usable(await core.swarm.lookup(core.source.key))
        trusted = core.options.trusted_peers
        if trusted is not None:  # the peers this API may route through
            online = [r for r in online if r.peer_id in trusted]
        gaps = missing_layers(online, total)
        coverage = schemas.Coverage(
            layers=total, served=total - sum(end - start for start, end in gaps), gaps=gaps, peers=len(online)
        )
        return schemas.ModelCard(id=names[0], created=created, key=core.source.key, coverage=coverage)

    @router.get("/models")
    async def models() -> schemas.ModelList:
        """The model this server serves, with how much of it the swarm covers now."""
        return schemas.ModelList(data=[await card()])

    @router.get("/models/{model:path}")
    async def model(model: str) -> schemas.ModelCard:
        if model not in names:
            raise unknown_model(model, names[0], lm.model.source.key)
        return await card()

    router.add_api_route("/chat/completions", completions.chat, methods=["POST"])
    router.add_api_route("/completions", completions.complete, methods=["POST"])
    app.include_router(router)
    add_web(app, lm)
    return app


async def _authorized(request: Request) -> None:
    if api_key_refused(request) is not None:
        raise APIError(
            401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def model_names(lm: SwarmLM) -> list[str]:
    """What requests may call the model: its display name, and its swarm key."""
    return [lm.model.source.name, lm.model.source.key]


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), made before the model loads so that a port in
    use fails at once; connections made meanwhile wait in its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def server(app: FastAPI) -> uvicorn.Server:
    """A uvicorn server for `app`, to run in the caller's loop (`await server.serve(sockets=[sock])`);
    it logs through the `logging` setup of its caller, and no line per request."""
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN
    )
    return uvicorn.Server(config)
