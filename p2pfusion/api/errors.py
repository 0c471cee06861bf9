"""Every error the API answers, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Clients (the `openai` package, LangChain, ...) pick their exception from the status alone, so each
failure gets the status OpenAI gives its like: 400 for a bad request (pydantic's validation errors
too, which FastAPI would answer with 422), 401, 404, 405, 413 for a prompt longer than the model or
the swarm takes, 503 with `Retry-After` while the swarm cannot serve (a gap, busy peers), and 500
when this server itself is at fault (its model's files, its own setup).
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from p2pfusion.api.schemas import ErrorBody, ErrorDetail
from p2pfusion.errors import (
    ConfigError, ModelError, P2PFusionError, PeerBusy, PromptTooLong, ProofError, RequestError, RouteError,
)

log = logging.getLogger(__name__)

RETRY_AFTER = 5  # seconds, when the swarm says nothing sooner: a warm backup takes over in about that
INVALID = "invalid_request_error"
SERVER_CODES = {ModelError: "model_error", ConfigError: "server_misconfigured", ProofError: "peer_proof_failed"}


class APIError(Exception):
    """An error answered as it is."""

    def __init__(
        self, status: int, message: str, kind: str = INVALID, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code))
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), self.status, self.headers)


def from_core(exc: P2PFusionError, prompt_param: str | None = None) -> APIError:
    """The API's answer to an error of the client core; `prompt_param` names the request's prompt
    field. The swarm's trouble is a 503 to retry; the request's, a 400 (413: too long); this
    server's own (its model, its setup, a peer's failed proof), a 500."""
    if isinstance(exc, PromptTooLong):
        return APIError(413, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, RouteError):
        hint = exc.retry_after if isinstance(exc, PeerBusy) and exc.retry_after is not None else RETRY_AFTER
        code = "peers_busy" if isinstance(exc, PeerBusy) else "swarm_unavailable"
        return APIError(503, str(exc), "server_error", code=code, headers={"Retry-After": str(math.ceil(hint))})
    if isinstance(exc, RequestError):
        return APIError(400, str(exc))
    return APIError(500, str(exc), "server_error", code=SERVER_CODES.get(type(exc)))


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, why, param=param, code="unsupported_parameter")


def unknown_model(asked: str, served: str, key: str) -> APIError:
    return APIError(
        404, f"The model '{asked}' does not exist here: this server serves {served} (key {key})",
        param="model", code="model_not_found",
    )


def install(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape, unmatched paths and methods included."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:  # the swarm's trouble, not the client's: its operator wants to know
            log.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        message = f"{'.'.join(where)}: {message}" if where else message
        return APIError(400, message, param=".".join(where) or None, code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()
