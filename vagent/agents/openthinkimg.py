"""``openthinkimg``: OpenThinkIMG (zhaochen0110/OpenThinkIMG), visual tool use with JSON actions (V-ToolRL).

Taken from the agent's own code (github.com/zhaochen0110/OpenThinkIMG):

* ``r1_v/open_r1/tool_grpo.py``: the prompt: the action list as a first user message (``SYSTEM_PROMPT``), then a
  user message with the image and the question; the model writes ``{"thought": ..., "actions": [...]}``.
* ``r1_v/open_r1/trainer/tool_generation.py``: a turn containing ``Terminate`` ends the episode (the answer is its
  ``ans``); otherwise the ``"actions"`` list is read and only its **first** action runs, on the newest image;
  the result is a user turn with the newest image and ``OBSERVATION:\\n{name} model outputs: {text}\\nPlease
  summarize the model outputs and answer my first question.``
* ``tool_server/tool_workers/online_workers/``: ``crop_worker.py`` (``param`` ``[x1, y1, x2, y2]`` in pixels,
  ``Image cropped successfully.``), ``DrawHorizontalLineByY_worker.py`` / ``DrawVerticalLineByX_worker.py``
  (points ``x="21.5" y="28.5"`` in **0-100 percent** of the image, values over 100 dropped; a line across the
  whole image; ``Line drawn successfully.`` / ``No valid points extracted.``).

Mapping: ``crop`` -> vagent ``crop``; the two line tools -> vagent ``draw`` (a full-width or full-height line,
percent converted by ``geometry.percent_to_original``); ``Terminate`` -> the answer. Not supported, because each
needs another model: ``OCR`` (an OCR model), ``Point`` (Molmo), ``ZoomInSubfigure`` (a grounding model),
``SegmentRegionAroundPoint`` (SAM); they get a "not available" observation in the same wrapper. Differences:
vagent draws a solid red line where the worker draws a dashed one with matplotlib (which also re-renders the
figure); a turn with neither a readable action nor ``Terminate`` ends the episode (the agent's loop appends the
question again as an assistant turn and goes on).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.geometry import percent_to_original
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "OpenThinkIMGProfile"]

SYSTEM_PROMPT = (
    "You are a visual assistant capable of generating and solving steps for chart-based reasoning. Your "
    "goal is to answer chart-related questions. You can rely on your own capabilities or use external "
    "tools to assist in solving. Here are the available actions:\n"
    '- **OCR**: Extracts text from an image. Example: `{"name": "OCR", "arguments": {"image": "img_1"}}`\n'
    "- **Point**: Identifies a point in the image based on description and returns coordinates. Example: "
    '`{"name": "Point", "arguments": {"image": "img_1", "param": "x-axis value 1970"}}`\n'
    '- **ZoomInSubfigure**: Crops the image to the specified subfigure. Example: `{"name": '
    '"ZoomInSubfigure", "arguments": {"image": "img_1", "param": "Downstream vs. Concept: Toy"}}`\n'
    '- **SegmentRegionAroundPoint**: Segments a region around a given point. Example: `{"name": '
    '"SegmentRegionAroundPoint", "arguments": {"image": "img_1", "param": "x="21.5" y="28.5""}}`\n'
    '- **DrawHorizontalLineByY**: Draws a horizontal line at a given y-coordinate. Example: `{"name": '
    '"DrawHorizontalLineByY", "arguments": {"image": "img_1", "param": "y=28.5"}}`\n'
    '- **DrawVerticalLineByX**: Draws a vertical line at a given x-coordinate. Example: `{"name": '
    '"DrawVerticalLineByX", "arguments": {"image": "img_1", "param": "x=21.5"}}`\n'
    '- **Terminate**: Ends the task and provides the final answer. Example: `{"name": "Terminate", '
    '"arguments": {"ans": "1985"}}`\n'
    "\n"
    "To solve the problem:\n"
    "1. Select actions from the provided tools list, combining them logically and building on previous "
    "steps. Call one action at a time, using its output for the next.\n"
    "2. To use `SegmentRegionAroundPoint`, `DrawHorizontalLineByY`, or `DrawVerticalLineByX`, first call "
    '"Point" to get coordinates for further actions.\n'
    "\n"
    "Your output should be in a strict JSON format as follows:\n"
    '{"thought": "the reasoning process", "actions": [{"name": "action", "arguments": {"argument1": '
    '"value1", "argument2": "value2"}}]}\n'
)
OBSERVATION = (
    "OBSERVATION:\n{name} model outputs: {text}\nPlease summarize the model outputs and answer my first question."
)
# tool_generation.extract_actions: the "actions" list, nested up to four levels.
_ACTIONS = re.compile(r'"actions"\s*:\s*(\[(?:[^\[\]]|\[(?:[^\[\]]|\[(?:[^\[\]]|\[[^\[\]]*\])*\])*\])*\])')
_TERMINATE = re.compile(r'"Terminate",\s*"arguments":\s*\{\s*"(?:ans|answer)":\s*(.*?)\}')
_CROP_PARAM = re.compile(r"\[\s*([\d,\s]+)\s*\]")
_POINT = re.compile(r'([xy])(\d*)\s*=\s*"?\s*([0-9]+(?:\.[0-9]+)?)"?')
_NEEDS_A_MODEL = {"ocr": "an OCR model", "point": "a pointing model (Molmo)",
                  "zoominsubfigure": "a grounding model", "segmentregionaroundpoint": "SAM"}  # fmt: skip
_NAMES = {"crop": "crop", "drawhorizontallinebyy": "DrawHorizontalLineByY", "drawverticallinebyx": "DrawVerticalLineByX",
          "ocr": "OCR", "point": "Point", "zoominsubfigure": "ZoomInSubfigure",
          "segmentregionaroundpoint": "SegmentRegionAroundPoint"}  # fmt: skip


class OpenThinkIMGProfile:
    """OpenThinkIMG's protocol (see the module docstring)."""

    name = "openthinkimg"
    stop_strings: tuple[str, ...] = ()
    inline = False
    limits = AgentLimits(max_turns=5, tool_min_pixels=28 * 28)  # its trainer's max_rounds default is per-config
    tools = ("crop", "draw")

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        # Two user messages, as its GRPO trainer builds them (the chat template adds its default system turn).
        return [Message.text("user", SYSTEM_PROMPT),
                Message("user", [*image_parts(images), ContentPart("text", question)])]  # fmt: skip

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        actions = _read_actions(text)
        if "Terminate" in text:  # the loop's own test, before any parsing
            terminate = [a for a in actions or [] if isinstance(a, dict) and a.get("name") == "Terminate"]
            args = terminate[0].get("arguments") if terminate else None
            if isinstance(args, dict) and ("ans" in args or "answer" in args):
                turn.answer = str(args.get("ans", args.get("answer"))).strip()
            else:  # its evaluator's regex fallback
                found = _TERMINATE.search(text)
                turn.answer = found.group(1).strip().strip('"').strip() if found else ""
            return turn
        if not actions:
            turn.errors.append(ParseError("bad_json", 'no readable "actions" list'))
            return turn
        first = actions[0]
        if not isinstance(first, dict) or not isinstance(first.get("name"), str):
            turn.actions = [
                ParseError("bad_call", f"an action must be {{'name': ..., 'arguments': ...}}, got {first!r}")
            ]
            turn.errors = list(turn.actions)
            return turn
        arguments = first.get("arguments") if isinstance(first.get("arguments"), dict) else {}
        call = ToolCall(first["name"], arguments, json.dumps(first))
        turn.actions, turn.tool_calls = [call], [call]
        if len(actions) > 1:
            turn.errors.append(ParseError("ignored_calls", f"{len(actions) - 1} later action(s) not run"))
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        key = call.name.lower()
        return "crop" if key == "crop" else "draw" if key in ("drawhorizontallinebyy", "drawverticallinebyx") else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._act_one(action, context) for action in parsed.actions]

    def _act_one(self, action: ToolCall | ParseError, context: ToolContext) -> Observation:
        newest = len(context.images) - 1
        if isinstance(action, ParseError):
            return _observation("", action.message, context.images[newest:], action.kind)
        key = action.name.lower()
        name = _NAMES.get(key, action.name)
        param = str(action.arguments.get("param", ""))
        tool_context = original_context(context, self.limits)
        if key == "crop":
            found = _CROP_PARAM.match(param)
            coords = [int(v) for v in found.group(1).split(",") if v.strip()] if found else []
            if len(coords) != 4:
                text = (f"Error processing line parameters '{param}': Invalid number of coordinates: {coords}" if found
                        else f"Parameter format mismatch: {param}")  # fmt: skip
                return _observation(name, text, context.images[newest:], "bad_arguments")
            result = run_tool("crop", {"bbox": coords, "image_index": newest}, tool_context)
            text = (
                "Image cropped successfully."
                if result.ok
                else f"Error processing line parameters '{param}': {result.text}"
            )
        elif key in ("drawhorizontallinebyy", "drawverticallinebyx"):
            size = context.images[newest].size
            points = [percent_to_original(p, size) for p in _points(param)]
            if not points:
                return _observation(name, "No valid points extracted.", context.images[newest:], "bad_arguments")
            horizontal = key == "drawhorizontallinebyy"
            lines = [[0, y, size[0], y] if horizontal else [x, 0, x, size[1]] for x, y in points]
            result = run_tool("draw", {"lines": lines, "image_index": newest}, tool_context)
            text = "Line drawn successfully." if result.ok else f"Error when drawing line: {result.text}"
        elif key in _NEEDS_A_MODEL:
            text = f"{name} is not available in vagent: it needs {_NEEDS_A_MODEL[key]}."
            return _observation(name, text, context.images[newest:], "unavailable")
        else:  # tool_name_mapping.get() is None: the tool manager cannot call it
            return _observation(name, f"Unknown tool {action.name}.", context.images[newest:], "unknown_tool")
        images = result.images if result.ok else context.images[newest:]  # the newest image goes back either way
        return Observation(text=OBSERVATION.format(name=name, text=text), images=images, error=result.error,
                           metadata=result.metadata)  # fmt: skip

    def observation_message(self, observation: Observation) -> Message:
        return Message("user", [*image_parts(observation.images), ContentPart("text", observation.text)])

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def _observation(name: str, text: str, images: list[Image.Image], error: str) -> Observation:
    return Observation(text=OBSERVATION.format(name=name, text=text), images=list(images), error=error)


def _read_actions(text: str) -> list | None:
    found = _ACTIONS.search(text)
    if not found:
        return None
    try:
        actions = json.loads(found.group(1))
    except json.JSONDecodeError:
        return None
    return actions if isinstance(actions, list) else None


def _points(param: str) -> list[tuple[float, float]]:
    """The worker's ``extract_points``: ``x1="12.6" y1="4.8" ...`` (or ``y=28.5``) grouped by index, in percent;
    a missing coordinate is 0 and a point with a value over 100 is dropped."""
    values: dict[str, dict[str, float]] = {}
    for axis, index, value in _POINT.findall(param):
        values.setdefault(index, {})[axis] = float(value)
    points = [(v.get("x", 0.0), v.get("y", 0.0)) for _, v in sorted(values.items())]
    return [p for p in points if max(p) <= 100]


PROFILE = OpenThinkIMGProfile()
