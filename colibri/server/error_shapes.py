"""Errors in the shape of the API a request speaks, wherever they arise (a handler, the API-key gate, an
unknown route): OpenAI's `{"error": {...}}` (the default), Anthropic's `{"type": "error", "error": {"type",
"message"}}` (its routes, or any request that carries `anthropic-version`, as its SDKs send), Ollama's
`{"error": "text"}` (/api/*, whatever the headers)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import APIError

# Anthropic's error types by status (docs.anthropic.com, "Errors"); a full queue is its 529 "overloaded"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   529: "overloaded_error"}


def api_of(scope) -> str:
    """"anthropic", "ollama" or "openai": whose error shape a request gets."""
    path = scope.get("path", "")
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/messages") or any(k == b"anthropic-version" for k, _ in scope.get("headers", ())):
        return "anthropic"
    return "openai"


def anthropic_status(e: APIError) -> int:
    return 529 if e.code == "queue_full" else e.status


def error_response(e: APIError, api: str) -> JSONResponse:
    if api == "anthropic":
        status = anthropic_status(e)
        kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=status)
    if api == "ollama":
        return JSONResponse({"error": e.message}, status_code=e.status)
    return JSONResponse(e.body(), status_code=e.status)
