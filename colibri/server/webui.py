"""`GET /`: a chat page in the browser (as llama-server's), over the server's own streamed
/v1/chat/completions: static files shipped in the package (server/webui/), no CDN and no build step; the
answers are rendered as markdown (code blocks, lists, tables) and sanitized.
Settings (system message, temperature, max tokens, the API key) live in the browser's localStorage."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse

router = APIRouter()
STATIC = Path(__file__).with_name("webui")
# marked (MIT) and DOMPurify (Apache-2.0 / MPL-2.0) from npm, as published (their source-map comments
# dropped; licenses next to them): the answers are rendered as markdown, sanitized before they reach the page
_KINDS = {"chat.js": "text/javascript", "chat.css": "text/css", "marked.umd.js": "text/javascript",
          "purify.min.js": "text/javascript"}


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/ui/{name}")
async def asset(name: str):
    if name not in _KINDS:
        return JSONResponse({"error": {"message": f"no web UI file {name}", "type": "not_found"}}, 404)
    return FileResponse(STATIC / name, media_type=_KINDS[name])
