"""The playground: a chat page at `/` that shows speculation at work (docs/playground.md).

Plain HTML, CSS and JavaScript in `playground/`, written for this server and served as they
are: no build step, nothing fetched from elsewhere. The page and its two files are open without
the API key (they hold no data); the page asks for the key and sends it with every API call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response

STATIC = Path(__file__).with_name("playground")
# file name -> media type: the whole set served; anything else under /playground/ is a 404
ASSETS = {"playground.js": "text/javascript; charset=utf-8",
          "playground.css": "text/css; charset=utf-8"}
PAGE_PATHS = frozenset({"/", *(f"/playground/{name}" for name in ASSETS)})
# The page runs only its own script and talks only to this server: model output that
# slipped into markup could still neither run nor load anything.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    """GET / (the page) and GET /playground/<file> (its script and style sheet)."""
    files = {name: (STATIC / name).read_bytes() for name in ("index.html", *ASSETS)}

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(files["index.html"], media_type="text/html; charset=utf-8",
                        headers=HEADERS)

    for name, media_type in ASSETS.items():
        app.add_api_route(f"/playground/{name}", _asset(files[name], media_type),
                          methods=["GET"], include_in_schema=False)


def _asset(body: bytes, media_type: str):
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return asset
