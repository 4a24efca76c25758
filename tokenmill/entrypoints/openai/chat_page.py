"""The chat page of `tokenmill serve`: GET / serves a small single-page app (static/, no build step).

The page talks to the server's own API from the browser: /v1/models for the model name and a
streamed /v1/chat/completions per answer, with the API key typed into the page as its Bearer token.
So the page's files are served outside the API key check (they hold nothing but the app), by an ASGI
middleware placed before AuthMiddleware; `--no-ui` leaves it out and GET / is a 404 (a 401 with
--api-key) as any unknown route. The files are read once, at start. They load nothing from elsewhere
(no CDN, no web fonts: the page works offline), which the Content-Security-Policy also enforces.
"""

from __future__ import annotations

from importlib import resources

from starlette.types import ASGIApp, Receive, Scope, Send

# URL path -> (file in static/, content type)
PAGES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}

# Everything from this origin only; the page's API calls included (connect-src).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def load_pages() -> dict[str, tuple[bytes, str]]:
    """URL path -> (file bytes, content type), from the package's static/ folder."""
    static = resources.files("tokenmill.entrypoints.openai").joinpath("static")
    return {path: (static.joinpath(name).read_bytes(), kind) for path, (name, kind) in PAGES.items()}


class ChatPageMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pages = load_pages()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        page = self.pages.get(scope.get("path", "")) if scope["type"] == "http" else None
        if page is None or scope.get("method") not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body, kind = page
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", kind.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-cache"),  # a new version of the server serves its new page at once
                (b"x-content-type-options", b"nosniff"),
                (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
            ],
        })
        await send({"type": "http.response.body", "body": body if scope.get("method") == "GET" else b""})
