"""What the server checks before a request reaches a route: the Host header names an allowed host
(a page on another site cannot reach a server on loopback through a DNS name it controls: DNS
rebinding), and, when the server has an API key, every route but ``/health`` and ``/metrics``
carries it: ``/v1``, FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``, and paths no route
serves. ``/health`` and ``/metrics`` need no key (probes and scrapers), but the same Host
check. A route is told by its path as Starlette matches it: less the ``root_path`` the app is
served under (a mount, a proxy's prefix).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, serialized with
ASCII escapes (a client's lone surrogate in a message cannot break the response)."""
from __future__ import annotations

import hmac
import json

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # the loopback names a local client uses
WILDCARD_BINDS = ("0.0.0.0", "::", "")  # binds on every interface: a client may use any of the machine's names
OPEN_ROUTES = frozenset({"/health", "/metrics"})  # the routes that need no API key: they show load, not text


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(message: str, kind: str = "invalid_request_error", param=None, code=None) -> bytes:
    return json.dumps(error_body(message, kind, param, code)).encode()


def host_name(value: str) -> str:
    """The host part of a Host header or an ``--allowed-hosts`` entry, lower case, without the
    port: ``[::1]:8000`` -> ``::1``, ``Example.com.:80`` -> ``example.com``."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[1:end] if end > 0 else ""
    if v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def default_hosts(bind: str) -> tuple[str, ...] | None:
    """The hosts a server bound to ``bind`` accepts by default: the bound address and the loopback
    names; None (any host) for a bind on every interface, where clients reach the machine by
    names the server cannot know (``--allowed-hosts`` narrows it)."""
    if host_name(bind) in WILDCARD_BINDS:
        return None
    return tuple(dict.fromkeys((host_name(bind), *LOCAL_HOSTS)))


def checked_api_key(api_key: str | None) -> str | None:
    """``api_key``, refused (ValueError) unless None (no key) or a non-empty string: an empty key
    would let ``Authorization: Bearer`` with nothing after it in."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError(f"api_key must be a non-empty string (None for no key), got {api_key!r}")
    return api_key


def route_path(scope) -> str:
    """The path Starlette matches routes against: the request's path less the ``root_path`` it
    starts with (``/llm/v1/models`` under ``/llm`` is ``/v1/models``)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


def bearer_token(header: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Guard:
    """ASGI middleware: refuses a request whose Host header is not an allowed host (400,
    ``invalid_host``), or, with an API key, a request without it for any route but
    ``OPEN_ROUTES`` (401, ``invalid_api_key``). ``hosts``: allowed host names (ports do not
    matter), None for any."""

    def __init__(self, app, hosts=LOCAL_HOSTS, api_key: str | None = None):
        self.app = app
        self.hosts = None if hosts is None else frozenset(host_name(h) for h in hosts)
        self.key = None if checked_api_key(api_key) is None else api_key.encode()

    def refusal(self, scope) -> tuple[int, bytes] | None:
        headers = dict(scope.get("headers") or [])
        if self.hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.hosts:
                return 400, error_bytes(f"the Host header {host!r} is not a host this server answers for "
                                        "(specgraph serve --allowed-hosts)", param="Host", code="invalid_host")
        if self.key is not None and route_path(scope) not in OPEN_ROUTES:
            token = bearer_token(headers.get(b"authorization", b""))
            if token is None or not hmac.compare_digest(token, self.key):
                return 401, error_bytes("missing or incorrect API key: send Authorization: Bearer <key>",
                                        code="invalid_api_key")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                status, body = refused
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


__all__ = ["Guard", "LOCAL_HOSTS", "OPEN_ROUTES", "checked_api_key", "default_hosts", "host_name", "route_path",
           "error_body", "error_bytes"]
