"""The gateway: an OpenAI-compatible (and Anthropic-compatible) server in front of an engine.

Every request belongs to a session. The gateway renders the request's messages to token ids
(reusing a session's earlier ids where the history matches, see `gateway.render`), calls the
engine with those ids, logs each call as a `Turn`, and turns the sampled ids back into the text
and tool calls of the API the client speaks.

The package, one concern per module:
- `app`: `Gateway` (the in-process API the trainer uses) and the routing; `config`: its config;
- `auth`: API keys, the admin token, which session a request belongs to;
- `core`: the generation path shared by every surface: session -> render -> engine -> token log;
  `request`: the one internal request (`GenRequest`) it takes, and the limits applied to it;
  `aio`: merging choice streams, and cleanup a cancellation cannot cut short;
- `surfaces/`: one module per API surface (chat completions, completions, responses, Anthropic
  messages), each translating its wire format to one internal `GenRequest` and back;
- `admin`: session, pause/resume and weight-version routes;
- `validation`: the error type, strict request models and the limits every surface shares;
- `http`: JSON bodies within limits, error responses, the uvicorn server (header limits).
"""

from gateway.server.app import Gateway
from gateway.server.config import GatewayConfig
from gateway.server.http import HttpServer
from gateway.server.validation import ApiError, RequestLimits

__all__ = ["ApiError", "Gateway", "GatewayConfig", "HttpServer", "RequestLimits"]
