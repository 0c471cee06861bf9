"""The web page served beside the API: a chat that streams replies through `/v1/chat/completions`,
and a live view of the swarm polled from `GET /v1/swarm`.

The page is plain HTML, CSS and JavaScript in `static/` (no build step, nothing fetched from
elsewhere), so it works on a machine with no internet. `/` opens the chat and `/swarm` the
dashboard. `/v1/swarm` is the JSON of `p2pfusion swarm --json` (client/survey.py), and
asks for the API key like every other `/v1` route when the API has one: it names the peers.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from p2pfusion.client.generate.swarm_lm import SwarmLM
from p2pfusion.client.survey import SwarmStatus

STATIC = Path(__file__).with_name("static")
# the page is small and changes with the package: browsers ask again each time rather than run a stale copy
NO_CACHE = {"Cache-Control": "no-cache"}


def api_key_refused(request: Request) -> JSONResponse | None:
    """A 401 in OpenAI's error shape unless the request bears one of the API keys
    (`app.state.api_keys`; none: open)."""
    keys = request.app.state.api_keys
    if not keys:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # every key compared, so that the time taken does not tell which one a guess came close to
    matches = [hmac.compare_digest(given.strip().encode(), key.encode()) for key in keys]
    if scheme.lower() == "bearer" and any(matches):
        return None
    error = {"message": "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
             "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def add_web(app: FastAPI, lm: SwarmLM) -> None:
    """Serve the page at `/` and `/swarm`, its files under `/static`, and the swarm's JSON at `/v1/swarm`."""
    core = lm.model.core
    # the API's own generations keep its model's observed speeds fresh
    status = SwarmStatus(core.swarm, {core.source.key: core.health})

    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=NO_CACHE)

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/swarm", page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/v1/swarm", tags=["swarm"])
    async def swarm(request: Request):
        """The models the swarm serves: coverage, gaps, peers, load and bottleneck (docs/web.md)."""
        refused = api_key_refused(request)
        if refused is not None:
            return refused
        return JSONResponse(await status.snapshot(), headers={"Cache-Control": "no-store"})
