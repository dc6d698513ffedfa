"""The chat page of `mlx-spec serve`: static files served at `/` and under `/ui/`."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).parent / "ui"
# Only the page's own files run and only its own server is called: model text that slipped
# past the renderer as markup still could not load or send anything.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_page_routes(app: FastAPI) -> None:
    """`GET /` (the page) and `/ui/*` (its script and style); they hold no data, so they are
    served without the API key, which the page asks for and sends to `/v1` itself."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(UI_DIR / "index.html", headers=HEADERS)

    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
