"""Who may do what: API keys, the admin token, and which session a request belongs to.

- Admin routes (session create/list/reward/close, pause/resume, weight version, and reading
  any session) always need the admin token. A gateway without a configured token makes a random
  one (`gateway.serve` prints it and writes it to a user-only file).
- `auth=keys`: the admin creates sessions; each has its own random key, which reaches only its
  own session.
- `auth=open`: any key works; the first valid request with a new key opens a session for it
  (`/sessions/NAME/v1/...` uses NAME as the key, for agents that can set only a base URL). The
  session's id is derived from the key (`o-` + a hash), so ids — which the admin lists and the
  trajectory log stores — never reveal keys. The owner reaches its session by the key itself:
  `/sessions/<key>/trajectory` (and `<key>~1` for the one closed before it).
- A session is readable by its own key or the admin; to anyone else an existing session and a
  missing one look the same (404).
Keys are compared as bytes in constant time, so any header value (non-ASCII included) is safe.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from starlette.requests import Request

from gateway.server.validation import ApiError
from gateway.sessions import Session, SessionStore

MAX_KEY_CHARS = 256


def api_key(request: Request) -> str | None:
    """The key of `Authorization: Bearer <key>` (or a bare value), else `x-api-key`."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else auth.strip()
    return request.headers.get("x-api-key")


def same_key(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    return hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    )


def open_session_id(key: str) -> str:
    """The id of the open-mode session of `key`: stable, and no way back to the key."""
    return "o-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


class Auth:
    def __init__(
        self, mode: Literal["open", "keys"], admin_token: str, sessions: SessionStore
    ) -> None:
        self.mode = mode
        self.admin_token = admin_token
        self.sessions = sessions

    def is_admin(self, request: Request) -> bool:
        return same_key(api_key(request), self.admin_token)

    def require_admin(self, request: Request) -> None:
        if not self.is_admin(request):
            raise ApiError(
                401,
                "admin routes need Authorization: Bearer <admin token> (gateway.serve prints it)",
                code="invalid_api_key",
            )

    def session_for(self, request: Request) -> tuple[Session, bool]:
        """The session a model request belongs to, and whether it was opened just now (open
        mode: the caller discards it again when the request fails)."""
        key = api_key(request)
        path_sid = request.path_params.get("sid")
        if self.mode == "open":
            name = path_sid or key or "default"
            if len(name) > MAX_KEY_CHARS:
                raise ApiError(
                    400,
                    f"the API key (the session name in auth=open) is over {MAX_KEY_CHARS} characters",
                    code="invalid_api_key",
                )
            session = self.sessions.by_key(name)
            created = session is None
            if session is None:
                session = self.sessions.create(session_id=open_session_id(name), api_key=name)
                session.open_mode = True
        else:
            if not key:
                raise ApiError(
                    401,
                    "missing API key: send Authorization: Bearer <session api_key>",
                    code="invalid_api_key",
                )
            session = self.sessions.by_key(key)
            created = False
            if session is None:
                raise ApiError(401, "invalid API key", code="invalid_api_key")
            if path_sid is not None and path_sid != session.id:
                raise ApiError(403, "this API key belongs to another session", code="wrong_session")
        if session.closed:
            raise ApiError(409, f"session {session.id!r} is closed", code="session_closed")
        return session, created

    def readable(self, request: Request, sid: str) -> Session:
        """The session `sid` for its owner or the admin; 404 for anyone else, as if missing."""
        if self.is_admin(request):
            session = self.sessions.get(sid)
        else:
            key = api_key(request)
            session = self.sessions.get(sid) or self._by_name(key, sid)
            if session is not None and not same_key(key, session.api_key):
                session = None
        if session is None:
            raise ApiError(404, f"session {sid!r} not found", code="session_not_found")
        return session

    def _by_name(self, key: str | None, sid: str) -> Session | None:
        """Open mode: the owner names its session by its key (`<key>~N`: an archived one)."""
        if self.mode != "open" or key is None:
            return None
        base, sep, n = sid.rpartition("~")
        if sep and n.isdigit() and base == key:
            return self.sessions.get(f"{open_session_id(key)}~{n}")
        return self.sessions.get(open_session_id(sid)) if sid == key else None
