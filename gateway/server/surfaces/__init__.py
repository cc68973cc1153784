"""API surfaces: each one translates its wire format to the one internal request and back.

A `Surface` owns its request models, `parse`s a JSON body into a `GenRequest` (the generation
core then checks every limit, whatever the surface), and builds the reply from the core's
`Event`s: a whole body (`reply`) or SSE bytes (`Streamer`). Adding a surface is adding a module
with a `Surface` subclass and listing it in `all_surfaces`.
"""

from __future__ import annotations

from gateway.server.surfaces.base import Surface


def all_surfaces() -> list[type[Surface]]:
    from gateway.server.surfaces.chat import ChatCompletions
    from gateway.server.surfaces.completions import Completions
    from gateway.server.surfaces.messages import Messages
    from gateway.server.surfaces.responses import Responses

    return [ChatCompletions, Completions, Responses, Messages]
