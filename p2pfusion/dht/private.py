"""DHT requests and answers signed with the swarm secret (net/secret.py), so that in a private
swarm only its members read or write records, or enter each other's routing tables.

hivemind's DHT passes every request and answer through an authorizer: a node whose check of a
request fails answers nothing, and a node whose check of an answer fails treats it as no answer.
Nodes without the secret (or with another) therefore get nothing from a private swarm's nodes,
and those nodes never take them into their routing tables.
"""

from __future__ import annotations

import hmac
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from p2pfusion.net.secret import MAX_SKEW, NONCE_BYTES, ReplayGuard, SwarmSecret


class SecretAuthorizer(AuthorizerBase):
    """An HMAC under the secret's DHT key over each request (its time and nonce included) and each
    answer (bound to its request's nonce); stale or replayed requests are refused."""

    def __init__(self, secret: SwarmSecret):
        self.secret = secret
        self._nonces = ReplayGuard()

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key=None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._mac(b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        if not hmac.compare_digest(signature, self._mac(b"request", request)):
            reason = "without the swarm secret" if not signature else "signed with another swarm secret"
        elif abs(auth.time - get_dht_time()) > MAX_SKEW:
            reason = "too old or too new (a clock more than a minute off?)"
        elif len(auth.nonce) != NONCE_BYTES or not self._nonces.fresh(auth.nonce):
            reason = "replayed"
        else:
            return True
        self.secret.note_refusal(f"DHT requests {reason}")
        return False

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(b"response", response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        if auth.nonce == request.auth.nonce and hmac.compare_digest(signature, self._mac(b"response", response)):
            return True
        self.secret.note_refusal("DHT answers without the swarm secret")
        return False

    def _mac(self, kind: bytes, message) -> bytes:
        return hmac.digest(self.secret.dht_key, kind + b"\0" + message.SerializeToString(), "sha256")
