"""POST /tokenize and /detokenize: the server's tokenizer and chat template, without generating.

A client counts a prompt's tokens before sending it (to fit the context or budget max_tokens), or
checks what the template makes of its messages; the shapes follow vLLM's endpoints of the same
names, with llama-server's `content` accepted for the text (docs/SERVER.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..errors import ColibriError
from .protocol import APIError, ChatMessage, _Strict, bad_request, parse

router = APIRouter()


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama-server's name for the text
    messages: list[ChatMessage] | None = None  # rendered with the chat template, as /v1/chat/completions does
    add_special_tokens: bool = True  # text only: the tokenizer's BOS etc. (a template writes its own)
    add_generation_prompt: bool = True
    with_pieces: bool = False  # also each token's text


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _ids(state, req: TokenizeRequest) -> list[int]:
    texts = [t for t in (req.prompt, req.content) if t is not None]
    if len(texts) + (req.messages is not None) != 1:
        raise bad_request("give exactly one of 'prompt' (or 'content') and 'messages'", "prompt")
    if req.messages is None:
        return state.tok.encode(texts[0], add_special_tokens=req.add_special_tokens)
    if state.template is None:
        raise APIError(400, f"messages need a chat template: {state.template_error}", "no_chat_template")
    try:
        text = state.template.render([m.for_template() for m in req.messages], req.add_generation_prompt)
    except ColibriError as e:
        raise bad_request(str(e), "messages", "chat_template_error") from None
    return state.tok.encode(text, add_special_tokens=False)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state = request.app.state.colibri
    req: TokenizeRequest = parse(TokenizeRequest, await request.body())
    state.check_model(req.model)
    ids = _ids(state, req)
    out: dict = {"tokens": ids, "count": len(ids), "max_model_len": state.engine.ctx_size}
    if req.with_pieces:
        out["pieces"] = [state.tok.decode([i], skip_special_tokens=False) for i in ids]
    return out


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state = request.app.state.colibri
    req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())
    state.check_model(req.model)
    vocab = state.tok.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must lie in [0, {vocab}): got {bad[:5]}", "tokens")
    return {"prompt": state.tok.decode(req.tokens, skip_special_tokens=False)}  # as /tokenize had them
