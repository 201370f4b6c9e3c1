"""The tool-call grammar: the system prompt that offers tools, the parser of model turns, and the
renderer of tool observations into the next turn.

Grammar (Qwen/Hermes function calling, which Qwen2.5-VL already knows)::

    <think>optional reasoning</think>
    <tool_call>{"name": "crop", "arguments": {"bbox": [x1, y1, x2, y2]}}</tool_call>
    ...
    <answer>final answer</answer>

Policy for imperfect output. Each case is a ``ParseError`` with a short kind that the engine counts
in its metrics; nothing here raises.

=========================================  ==================  ============================================
model wrote                                kind                what happens
=========================================  ==================  ============================================
several ``<tool_call>`` blocks             (none)              all run, in order, one tool turn each
a call and an ``<answer>``                 ``call_with_answer`` the answer ends the episode; calls not run
several ``<answer>`` blocks                ``multiple_answers`` the first one counts
``<answer></answer>`` (empty)              ``empty_answer``    the episode ends with an empty answer
unclosed ``<tool_call>``/``<answer>``      ``unclosed_tag``    repaired: the text up to the end is the body
a closing tag with no opening tag          ``stray_tag``       ignored
a tag inside a closed ``<answer>``         ``tag_in_answer``   the answer counts as written, tags included
trailing commas, single quotes,            ``repaired_json``   repaired; the call runs
Python literals (True/None)
``arguments`` double-encoded as a string   ``repaired_json``   decoded; the call runs
JSON that cannot be repaired               ``bad_json``        an error observation for that call
not ``{"name": str, "arguments": {}}``     ``bad_call``        an error observation for that call
a ``<tool_call>`` inside ``<think>``       (none)              it is reasoning, not a call: not run
=========================================  ==================  ============================================

Unknown tool names (``unknown_tool``) and missing/extra/wrong-typed arguments (``bad_arguments``) are
checked against the tool's JSON schema at dispatch (``vagent.toolbox.call_tool``); they too come back
to the model as error observations. A turn with neither a call nor an answer ends the episode
(stop reason ``no_action``). ``ParsedTurn.actions`` keeps the calls and the failed calls in the order
they were written, so the model gets one tool turn per ``<tool_call>`` block.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from vagent.types import Observation, ToolCall

__all__ = [
    "ParseError",
    "ParsedTurn",
    "observation_content",
    "observation_text",
    "parse_turn",
    "system_prompt",
]

_TAGS = "tool_call|answer|think"
_BLOCK = re.compile(rf"<({_TAGS})>(.*?)(?:</\1>|$)", re.DOTALL)
_CLOSING = re.compile(rf"</({_TAGS})>")
_TAG = re.compile(rf"</?({_TAGS})>")
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


@dataclass
class ParseError:
    """One problem found in a model turn. ``kind`` is a short, countable label."""

    kind: str
    message: str


@dataclass
class ParsedTurn:
    """What a model turn said: calls to run, the final answer, reasoning, and what was wrong with it.

    Attributes:
        tool_calls: The well-formed calls, in order (empty when the turn also answered).
        actions: One entry per ``<tool_call>`` block in order: the ``ToolCall``, or the ``ParseError``
            (kind ``bad_json`` or ``bad_call``) of a block that could not be parsed. Empty when the turn answered.
        answer: The text of the first ``<answer>``, stripped; None when there is none.
        think: The text of the ``<think>`` blocks, joined.
        errors: Every problem found, including the ones in ``actions``.
    """

    tool_calls: list[ToolCall] = field(default_factory=list)
    actions: list[ToolCall | ParseError] = field(default_factory=list)
    answer: str | None = None
    think: str | None = None
    errors: list[ParseError] = field(default_factory=list)

    @property
    def error_kinds(self) -> list[str]:
        return [e.kind for e in self.errors]


def system_prompt(tool_schemas: list[dict[str, Any]], instructions: str | None = None) -> str:
    """The system prompt listing the offered tools as JSON function schemas (Hermes style).

    Args:
        tool_schemas: ``{"name", "description", "parameters"}`` dicts, one per tool.
        instructions: Replaces the default first paragraph.
    """
    look = (
        "When a detail is too small or unclear, call a tool to look closer; its result comes back in the next turn. "
        if tool_schemas
        else ""  # a tool-free episode (no-tool baselines) is not told to call tools it does not have
    )
    head = instructions or (
        "You are a helpful assistant that answers questions about images and videos. "
        f"Think step by step inside <think></think>. {look}Put the final answer inside <answer></answer>."
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


class _JsonNames(ast.NodeTransformer):
    """Reads JSON's ``true``/``false``/``null`` (and Python's spellings) as constants; any other name fails."""

    def visit_Name(self, node: ast.Name) -> ast.Constant:
        if node.id not in _LITERAL_NAMES:
            raise ValueError(f"unexpected name {node.id!r}")
        return ast.copy_location(ast.Constant(_LITERAL_NAMES[node.id]), node)


_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _load_json(text: str) -> tuple[Any, bool]:
    """Parse JSON, repairing trailing commas and single-quoted (Python literal) objects. Returns (value, repaired)."""
    try:
        return json.loads(text), False
    except (json.JSONDecodeError, RecursionError):
        pass
    fixed = _TRAILING_COMMA.sub(r"\1", text)
    try:
        return json.loads(fixed), True
    except (json.JSONDecodeError, RecursionError):
        pass
    # Single quotes and Python literals: read it as a Python expression, allowing only literals. Names
    # are mapped on the syntax tree (not by string replacement, which would corrupt "construe").
    try:
        with warnings.catch_warnings():  # model text like '\>' would warn about invalid escape sequences
            warnings.simplefilter("ignore")
            tree = _JsonNames().visit(ast.parse(fixed.strip(), mode="eval"))
        return ast.literal_eval(tree), True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError("not valid JSON") from None


def _parse_call(body: str) -> tuple[ToolCall | ParseError, bool]:
    """One ``<tool_call>`` body -> (the call or why not, whether its JSON was repaired)."""
    raw = body.strip()
    try:
        data, repaired = _load_json(raw)
    except ValueError:
        return ParseError("bad_json", f"the tool call is not valid JSON: {raw[:200]!r}"), False
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ParseError("bad_call", 'a tool call must be {"name": <string>, "arguments": {...}}'), repaired
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # double-encoded: "arguments": "{\"bbox\": [...]}"
        try:
            arguments, _ = _load_json(arguments)
            repaired = True
        except ValueError:
            return ParseError("bad_json", f"the arguments of {data['name']!r} are not valid JSON"), repaired
    if not isinstance(arguments, dict):
        return ParseError("bad_call", f"the arguments of {data['name']!r} must be a JSON object"), repaired
    return ToolCall(name=data["name"], arguments=arguments, raw=raw), repaired


def parse_turn(text: str) -> ParsedTurn:
    """Parse one assistant turn. Never raises; problems are listed in ``errors`` (see the module docstring).

    >>> turn = parse_turn('<think>too small</think><tool_call>{"name": "crop", "arguments": {"bbox": [1, 2, 9, 9],}}')
    >>> turn.think, turn.tool_calls[0].arguments, turn.error_kinds
    ('too small', {'bbox': [1, 2, 9, 9]}, ['unclosed_tag', 'repaired_json'])
    """
    turn = ParsedTurn()
    thoughts, answers, spans = [], [], []
    for match in _BLOCK.finditer(text):
        tag, body = match.group(1), match.group(2)
        spans.append(match.span())
        closed = match.group(0).endswith(f"</{tag}>")
        if not closed:
            turn.errors.append(ParseError("unclosed_tag", f"<{tag}> was not closed"))
        if tag == "think":
            thoughts.append(body.strip())
        elif tag == "answer":
            answers.append(body.strip())
            # A grammar tag inside a closed answer, e.g. '<answer>up</think>\n<tool_call>\n<think>down</answer>' (an
            # unclosed one is already an error, and its body runs to the end of the turn).
            if closed and len(answers) == 1 and (inner := _TAG.search(body)):
                turn.errors.append(ParseError("tag_in_answer", f"{inner.group(0)} inside the <answer>"))
        else:
            action, repaired = _parse_call(body)
            if repaired:
                name = action.name if isinstance(action, ToolCall) else "a tool"
                turn.errors.append(ParseError("repaired_json", f"repaired malformed JSON in the call to {name!r}"))
            if isinstance(action, ParseError):
                turn.errors.append(action)
            turn.actions.append(action)
    # A closing tag the blocks above did not consume had no opening tag (e.g. '{"name": ...}</tool_call>').
    if any(not any(a <= m.start() < b for a, b in spans) for m in _CLOSING.finditer(text)):
        turn.errors.append(ParseError("stray_tag", "a closing tag had no matching opening tag; it was ignored"))
    turn.think = "\n".join(thoughts) if thoughts else None
    if answers:
        turn.answer = answers[0]
        if len(answers) > 1:
            turn.errors.append(ParseError("multiple_answers", f"{len(answers)} <answer> blocks; the first counts"))
        if not turn.answer:
            turn.errors.append(ParseError("empty_answer", "the <answer> is empty"))
        if turn.actions:
            turn.errors.append(
                ParseError("call_with_answer", "a turn with an <answer> ends the episode; its calls were not run")
            )
            turn.actions = []
    turn.tool_calls = [a for a in turn.actions if isinstance(a, ToolCall)]
    return turn


def observation_text(observation: Observation) -> str:
    """The text the model reads for an observation: failures are marked so the model can tell, and returned images
    are labelled with their indices in the episode (``observation.first_image``, set by the engine once it knows
    them), so a later ``image_index`` can name them.

    >>> observation_text(Observation(text="cropped region [0, 0, 9, 9] of image 0.", images=[None], first_image=2))
    'Image 2: cropped region [0, 0, 9, 9] of image 0.'
    >>> observation_text(Observation(text="2 frame(s) of video 0.", images=[None, None], first_image=1))
    'Images 1–2: 2 frame(s) of video 0.'
    """
    text = f"Error: {observation.text}" if observation.error else observation.text
    first, n = observation.first_image, len(observation.images)
    if first is None or n == 0:
        return text
    return f"{f'Image {first}' if n == 1 else f'Images {first}–{first + n - 1}'}: {text}"


def observation_content(observation: Observation) -> list[dict[str, Any]]:
    """Chat-template content of a ``tool`` turn: the observation's images, then its text.

    Video frames (``observation.timestamps`` set) are each preceded by their time, so the model can
    tell when what it sees happened: ``[{"type": "text", "text": "t=1.50s"}, {"type": "image"}, ...]``.
    """
    content: list[dict[str, Any]] = []
    for i, _ in enumerate(observation.images):
        if observation.timestamps is not None and i < len(observation.timestamps):
            content.append({"type": "text", "text": f"t={observation.timestamps[i]:.2f}s"})
        content.append({"type": "image"})
    content.append({"type": "text", "text": observation_text(observation)})
    return content
