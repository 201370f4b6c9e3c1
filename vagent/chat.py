"""The tool-call grammar: the system prompt that offers tools, the parser of model turns, and the
renderer of tool observations into the next turn.

Grammar (Qwen/Hermes function calling, which Qwen2.5-VL already knows)::

    <think>optional reasoning</think>
    <tool_call>{"name": "crop", "arguments": {"bbox": [x1, y1, x2, y2]}}</tool_call>
    ...
    <answer>final answer</answer>

Policy for imperfect output (every case becomes a ``ParseError`` with a kind, never an exception):

* several ``<tool_call>`` blocks in one turn: all are run, in order;
* a call and an ``<answer>`` in the same turn: the answer ends the episode, the calls are not run
  (kind ``call_with_answer``), because the model already committed to an answer;
* an unclosed ``<tool_call>`` or ``<answer>`` at the end of the text: repaired (the turn was cut by a
  stop or the token budget) and counted as ``unclosed_tag``;
* JSON with trailing commas or single quotes (Python-literal style) is repaired and counted as
  ``repaired_json``; anything still unparseable is ``bad_json``;
* ``arguments`` double-encoded as a JSON string is decoded (``repaired_json``);
* a call without a string ``name`` or an object ``arguments`` is ``bad_call``.

Unknown tools and missing/extra/wrong-typed arguments are checked at dispatch (``vagent.toolbox``).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from vagent.types import Observation, ToolCall

__all__ = ["ParseError", "ParsedTurn", "observation_content", "parse_turn", "system_prompt"]

_BLOCK = re.compile(r"<(tool_call|answer|think)>(.*?)(?:</\1>|$)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


@dataclass
class ParseError:
    """One problem found in a model turn. ``kind`` is a short, countable label."""

    kind: str
    message: str


@dataclass
class ParsedTurn:
    """What a model turn said: calls to run, the final answer, reasoning, and what was wrong with it."""

    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    think: str | None = None
    errors: list[ParseError] = field(default_factory=list)


def system_prompt(tool_schemas: list[dict[str, Any]], instructions: str | None = None) -> str:
    """The system prompt listing the offered tools as JSON function schemas (Hermes style).

    Args:
        tool_schemas: ``{"name", "description", "parameters"}`` dicts, one per tool.
        instructions: Replaces the default first paragraph.
    """
    head = instructions or (
        "You are a helpful assistant that answers questions about images and videos. "
        "Think step by step inside <think></think>. When a detail is too small or unclear, call a tool "
        "to look closer; its result comes back in the next turn. Put the final answer inside <answer></answer>."
    )
    if not tool_schemas:
        return head
    tools = "\n".join(json.dumps({"type": "function", "function": schema}) for schema in tool_schemas)
    return (
        f"{head}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


def _load_json(text: str) -> tuple[Any, bool]:
    """Parse JSON, repairing trailing commas and single-quoted (Python literal) objects. Returns (value, repaired)."""
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    fixed = _TRAILING_COMMA.sub(r"\1", text)
    try:
        return json.loads(fixed), True
    except json.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(fixed.replace("true", "True").replace("false", "False").replace("null", "None"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError("not valid JSON") from None
    return value, True


def _parse_call(body: str, errors: list[ParseError]) -> ToolCall | None:
    raw = body.strip()
    try:
        data, repaired = _load_json(raw)
    except ValueError:
        errors.append(ParseError("bad_json", f"the tool call is not valid JSON: {raw[:200]!r}"))
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        errors.append(ParseError("bad_call", 'a tool call must be {"name": <string>, "arguments": {...}}'))
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # double-encoded: "arguments": "{\"bbox\": [...]}"
        try:
            arguments, _ = _load_json(arguments)
            repaired = True
        except ValueError:
            errors.append(ParseError("bad_json", f"the arguments of {data['name']!r} are not valid JSON"))
            return None
    if not isinstance(arguments, dict):
        errors.append(ParseError("bad_call", f"the arguments of {data['name']!r} must be a JSON object"))
        return None
    if repaired:
        errors.append(ParseError("repaired_json", f"repaired malformed JSON in the call to {data['name']!r}"))
    return ToolCall(name=data["name"], arguments=arguments, raw=raw)


def parse_turn(text: str) -> ParsedTurn:
    """Parse one assistant turn. Never raises; problems are listed in ``errors``."""
    turn = ParsedTurn()
    for match in _BLOCK.finditer(text):
        tag, body = match.group(1), match.group(2)
        if not match.group(0).endswith(f"</{tag}>"):
            turn.errors.append(ParseError("unclosed_tag", f"<{tag}> was not closed"))
        if tag == "think":
            turn.think = body.strip()
        elif tag == "answer":
            turn.answer = body.strip()
        else:
            call = _parse_call(body, turn.errors)
            if call is not None:
                turn.tool_calls.append(call)
    if turn.answer is not None and turn.tool_calls:
        turn.errors.append(
            ParseError("call_with_answer", "a turn with an <answer> ends the episode; its calls were not run")
        )
        turn.tool_calls = []
    return turn


def observation_content(observation: Observation) -> list[dict[str, Any]]:
    """Chat-template content of a ``tool`` turn: the observation's images, then its text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in observation.images]
    content.append({"type": "text", "text": observation.text})
    return content
