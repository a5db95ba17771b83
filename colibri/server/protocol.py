"""The OpenAI request bodies the server accepts, and its OpenAI-shaped errors.

Bodies are validated strictly (a string where a number belongs is a 400, as OpenAI does); fields
the server does not know are ignored; fields it knows but does not implement (functions, best_of > n,
suffix, ...) are refused with a 400 that names them (docs/SERVER.md).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from ..errors import ColibriError

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "code", "param"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": STATUS_TYPES.get(self.status, "server_error"),
                          "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def refuse_unsupported(self) -> None:
        """A 400 naming a known field this server does not implement (bodies with such fields)."""


class TextPart(_Strict):
    type: str
    text: str | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class CalledFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    def for_template(self) -> dict:
        """The message as a chat template sees it: content flattened to one string."""
        if isinstance(self.content, list):
            parts = []
            for p in self.content:
                if p.type != "text" or p.text is None:
                    raise bad_request(f"content parts of type '{p.type}' are not supported (text only)",
                                      "messages", "unsupported_content")
                parts.append(p.text)
            content = "".join(parts)
        elif self.content is None:
            if self.role != "assistant":
                raise bad_request(f"a '{self.role}' message needs content", "messages")
            content = ""
        else:
            content = self.content
        # 'developer' is OpenAI's newer name for the system role; templates know only 'system'.
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates write `arguments | tojson` (transformers' convention: a dict): a JSON string is parsed.
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": parse_arguments(c.function.arguments)}} for c in self.tool_calls]
        return out


def parse_arguments(args: str | dict) -> Any:
    """A tool call's arguments as an object where its JSON text parses (what templates and Ollama want)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_N = 16  # choices per prompt (each takes a slot or waits in the queue)
# A temperature this small samples as 0 (greedy, which it is in effect): logits divided by almost nothing
# overflow to inf, which the sampler cannot draw from.
MIN_TEMPERATURE = 1e-6
Temperature = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extension (llama.cpp, vLLM)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # extension (llama.cpp, vLLM)
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None  # extension (llama.cpp)
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None  # extension (llama.cpp): its window, default 64
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate past end-of-sequence (benchmarks)
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # choices per prompt: separate requests, seeds seed + i
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # {"token id": bias}
    response_format: ResponseFormat | None = None  # structured output (engine/grammar.py)
    json_schema: dict[str, Any] | None = None  # extension (llama-server): the schema itself
    grammar: str | None = None  # extension (llama-server): a GBNF (or Lark) grammar
    # extension: "auto" | "lookup" | "draft" | "off" (engine/speculative.py; unset: the server's --spec); refused by
    # the engine
    speculative: str | None = None
    user: str | None = None
    _grammar: tuple[str | None] | None = PrivateAttr(default=None)  # (constraint(),) once made

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def sampling_kw(self, choice: int = 0) -> dict:
        """Keywords for `Engine.submit`: OpenAI's defaults (temperature 1, top_p 1) where unset; choice i
        of n samples with seed + i (the choices differ, the request stays reproducible)."""
        t = 1.0 if self.temperature is None else self.temperature
        return {"temperature": t if t >= MIN_TEMPERATURE else 0.0,
                "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": self.top_k or 0,
                "min_p": self.min_p or 0.0,
                "repeat_penalty": 1.0 if self.repeat_penalty is None else self.repeat_penalty,
                "repeat_last_n": 64 if self.repeat_last_n is None else self.repeat_last_n,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "seed": None if self.seed is None else (self.seed + choice) % 2**63,
                "logit_bias": self.token_biases(), "grammar": self.constraint(),
                **({} if self.speculative is None else {"speculative": self.speculative})}

    @property
    def json_mode(self) -> bool:
        """The answer must be JSON (response_format json_object / json_schema, or llama's json_schema)."""
        rf = self.response_format
        return self.json_schema is not None or (rf is not None and rf.type != "text")

    def constraint(self) -> str | None:
        """The grammar of response_format (json_object: any JSON object; json_schema: that schema), of
        llama-server's `json_schema` or of its `grammar` (GBNF); None for plain text. Made once (the body is
        checked at parse, then each of n choices submits it)."""
        if self._grammar is None:
            self._grammar = (self._checked_constraint(),)
        return self._grammar[0]

    def _checked_constraint(self) -> str | None:
        rf = self.response_format
        given = [n for n, v in (("response_format", rf is not None and rf.type != "text"),
                                ("json_schema", self.json_schema is not None), ("grammar", self.grammar is not None))
                 if v]
        if len(given) > 1:
            raise bad_request(f"give one of {' and '.join(given)}, not several", given[-1])
        try:
            return self._constraint()
        except ColibriError as e:  # a bad schema or grammar; llguidance missing
            raise bad_request(str(e), given[0] if given else None) from None

    def _constraint(self) -> str | None:
        from ..engine.grammar import gbnf_grammar, json_grammar

        rf = self.response_format
        if self.grammar is not None:
            return gbnf_grammar(self.grammar)
        if self.json_schema is not None:
            return json_grammar(self.json_schema)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return json_grammar(None)
        if rf.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema", "response_format")
        return json_grammar(rf.json_schema.schema_ or {})

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids, as JSON object keys are strings) as integers."""
        if not self.logit_bias:
            return None
        bad = next((k for k in self.logit_bias if not k.isdigit()), None)
        if bad is not None:
            raise bad_request(f"logit_bias keys must be token ids, got {bad!r}", "logit_bias")
        return {int(k): float(v) for k, v in self.logit_bias.items()}

    def refuse_unsupported(self) -> None:
        self.token_biases()
        self.constraint()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.stop_strings()


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): extra template variables
    tools: list[Tool] | None = None  # colibri/server/tools.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions:
            raise bad_request("functions (the deprecated form) is not supported: send tools", "functions",
                              "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, self.n):
            raise bad_request("best_of other than n is not supported (no ranking of choices)", "best_of",
                              "unsupported_value")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be an empty list", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def parse(model: type[BaseModel], raw: bytes):
    """Validate a JSON body; a one-line 400 on the first problem."""
    try:
        req = model.model_validate_json(raw or b"null")
    except ValidationError as e:
        errs = e.errors()
        # A union field (stop, prompt, ...) reports one error per member: a range or length error
        # says more than "wrong type" for each member.
        err = next((x for x in errs if not x["type"].endswith("_type")), errs[0])
        loc = ".".join(str(x) for x in err["loc"] if not _union_tag(x))
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}", None, "invalid_json") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the body must be a JSON object", None, "invalid_json") from None
        msg = err["msg"] if err["type"] != "missing" else "is required"
        raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None,
                          "missing_parameter" if err["type"] == "missing" else "invalid_value") from None
    req.refuse_unsupported()
    return req


def _union_tag(part) -> bool:
    """pydantic names the member of a union in an error's location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none")
                                      or part.startswith(("constrained-", "function-")))
