"""OpenAI chat-completion requests -> vagent messages, with every check a public endpoint needs.

Guards against: malformed bodies and fields (wrong types, out-of-range sampling settings), unknown roles and
content parts, images that are not images, decompression bombs (pixel count checked from the header), local
paths outside the allowed roots (symlinks resolved first) and any network fetch (``http(s)://`` is refused, not
downloaded). Every problem is an ``APIError`` naming the offending field, so the client gets a 4xx with an
OpenAI-style body and the server goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image

from vagent.chat import system_prompt
from vagent.media import MediaError, load_image
from vagent.types import ContentPart, Message

__all__ = ["APIError", "ChatRequest", "parse_chat_request"]

MAX_N = 16  # samples per request: each is a row of the batch
MAX_STOPS = 4  # as OpenAI


class APIError(Exception):
    """A request the server refuses; becomes ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A validated chat-completion request.

    Attributes:
        id: ``chatcmpl-...``, also the seeded lane's identity.
        messages: The conversation as vagent messages (images decoded, full resolution), system prompt included.
        tools: The offered function schemas (``{"name", "description", "parameters"}``); empty = no tools.
        temperature, top_p, stop, seed, n, stream: As OpenAI defines them.
        max_tokens: The client's limit, or None (the server picks one that fits the context).
        include_usage: ``stream_options.include_usage``: a last chunk with the token counts.
        continue_final_message: The last message is an unfinished assistant turn to continue (vLLM's extension);
            in agent mode trailing assistant messages are forced turns (the tool loop runs their calls).
        logprobs: Return each sampled token's log-prob (the model's own, at temperature 1, as training uses).
        max_turns: Agent mode's turn budget for this request (vagent's extension; at most the server's), or None
            (the server's).
    """

    id: str
    messages: list[Message]
    model: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    continue_final_message: bool = False
    logprobs: bool = False
    max_turns: int | None = None

    @property
    def images(self) -> list[Image.Image]:
        return [part.image for m in self.messages for part in m.content if part.image is not None]


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise APIError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise APIError(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


def parse_chat_request(
    raw: bytes, *, model_name: str, allowed_roots: list[Path], max_image_pixels: int, tools_in_prompt: bool = True
) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body and decode its images.

    ``tools_in_prompt`` False (agent mode) keeps the offered tools out of the messages: the engine writes its own
    system prompt.

    Raises:
        APIError: 400 for anything malformed, 404 for an unknown model.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise APIError(f"the model '{body.get('model')}' does not exist; this server serves '{model_name}'",
                       status=404, param="model", code="model_not_found")  # fmt: skip
    request = ChatRequest(id=f"chatcmpl-{uuid.uuid4().hex}", messages=[], model=model_name)
    request.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    request.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if request.top_p == 0:
        raise APIError("'top_p' must be above 0 (use temperature 0 for greedy decoding)", param="top_p")
    request.max_tokens = _integer(body, "max_completion_tokens", None, 1) or _integer(body, "max_tokens", None, 1)
    request.n = _integer(body, "n", 1, 1, MAX_N)
    request.seed = _integer(body, "seed", None, -(2**63), 2**63 - 1)
    request.stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    request.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    request.continue_final_message = bool(body.get("continue_final_message", False))
    request.logprobs = bool(body.get("logprobs", False))
    if request.logprobs and (body.get("top_logprobs") or request.stream):
        raise APIError("logprobs are returned for the sampled tokens of non-streamed requests only "
                       "(no top_logprobs, no stream)", param="top_logprobs" if body.get("top_logprobs") else "stream")  # fmt: skip
    request.max_turns = _integer(body, "max_turns", None, 1)
    request.stop = _stops(body.get("stop"))
    request.tools = _tools(body.get("tools"), body.get("tool_choice"))
    in_prompt = request.tools if tools_in_prompt else []
    request.messages = _messages(body.get("messages"), in_prompt, allowed_roots, max_image_pixels)
    if request.continue_final_message and request.messages[-1].role != "assistant":
        raise APIError("continue_final_message needs an assistant message last", param="messages")
    return request


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS}", param="stop")
    return tuple(stops)


def _tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]]:
    if tools is None or tool_choice == "none":
        return []
    if tool_choice not in (None, "auto"):
        raise APIError("only tool_choice 'auto' and 'none' are supported", param="tool_choice")
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list", param="tools")
    schemas = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError('each tool must be {"type": "function", "function": {"name": ...}}', param=f"tools[{i}]")
        schemas.append({k: function[k] for k in ("name", "description", "parameters") if k in function})
    return schemas


def _messages(messages: Any, tools: list[dict], roots: list[Path], max_pixels: int) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                         "tool"):  # fmt: skip
            raise APIError("each message needs a role: system, user, assistant or tool", param=param)
        role = "system" if message["role"] == "developer" else message["role"]
        # a tool turn carries its images back (a crop), as vagent's protocol renders it and as vLLM accepts it
        parts = _content(message.get("content"), param, roots, max_pixels, images_allowed=role in ("user", "tool"))
        if role == "assistant":
            parts += [ContentPart("text", _call_text(call, f"{param}.tool_calls[{j}]"))
                      for j, call in enumerate(message.get("tool_calls") or [])]  # fmt: skip
        out.append(Message(role, parts))
    system = [m for m in out if m.role == "system"]
    if len(system) > 1 or (system and out[0].role != "system"):
        raise APIError("at most one system message, and it must come first", param="messages")
    if tools:  # the function schemas go into the system prompt, as Qwen's template does
        instructions = system[0].plain_text if system else "You are a helpful assistant."
        prompt = Message.text("system", system_prompt(tools, instructions=instructions))
        out = [prompt, *out[1:]] if system else [prompt, *out]
    return out


def _call_text(call: Any, param: str) -> str:
    """An earlier assistant turn's tool call in the grammar the model writes (``<tool_call>{json}</tool_call>``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError("a tool call needs function.name", param=param)
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (json.JSONDecodeError, TypeError):
        raise APIError("tool call arguments must be a JSON string", param=f"{param}.function.arguments") from None
    return "<tool_call>\n" + json.dumps({"name": function["name"], "arguments": arguments}) + "\n</tool_call>"


def _content(content: Any, param: str, roots: list[Path], max_pixels: int, images_allowed: bool) -> list[ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [ContentPart("text", content)]
    if not isinstance(content, list):
        raise APIError("message content must be a string or a list of parts", param=f"{param}.content")
    parts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(ContentPart("text", part["text"]))
        elif kind == "image_url" and images_allowed:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise APIError("image_url needs a url", param=where)
            parts.append(ContentPart("image", image=_image(url, where, roots, max_pixels)))
        elif kind == "image_url":
            raise APIError("images are accepted in user and tool messages only", param=where)
        else:
            raise APIError(f"unsupported content part {kind!r}: use 'text' or 'image_url'", param=where)
    return parts


def _image(url: str, param: str, roots: list[Path], max_pixels: int) -> Image.Image:
    """Decode a ``data:`` URL or open a local file under an allowed root. Never fetches from the network."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise APIError("data URLs must be base64-encoded", param=param, code="invalid_image")
        try:
            source: bytes | Path = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError("the data URL is not valid base64", param=param, code="invalid_image") from None
    else:
        parsed = urlparse(url)
        if parsed.scheme not in ("", "file"):
            raise APIError(f"'{parsed.scheme}' image URLs are not fetched: send a data: URL or a local path",
                           param=param, code="invalid_image")  # fmt: skip
        path = Path(unquote(parsed.path) if parsed.scheme == "file" else url).resolve()
        if not any(path.is_relative_to(root) for root in roots):
            raise APIError("local image paths must be under an --allowed-media-root"
                           + ("" if roots else " (none is set)"), param=param, code="invalid_image")  # fmt: skip
        source = path
    try:
        return load_image(source, max_pixels=max_pixels)
    except MediaError as e:
        # For inline bytes drop PIL's parenthesised detail, which names an internal BytesIO object.
        message = str(e) if isinstance(source, Path) else str(e).split(" (")[0].replace("<bytes>", "the image")
        raise APIError(f"invalid image: {message}", param=param, code="invalid_image") from None
