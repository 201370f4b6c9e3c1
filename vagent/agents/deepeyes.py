"""``deepeyes``: DeepEyes (Visual-Agent/DeepEyes), the zoom-in agent trained end to end with RL.

Taken from the agent's own code (github.com/Visual-Agent/DeepEyes):

* ``eval/eval_vstar.py``: the system prompt (the ``image_zoom_in_tool`` schema), the user prompt
  (question, then ``USER_PROMPT_V2``), and the observation: a *user* turn ``<tool_response>`` + the crop +
  ``USER_PROMPT_V2`` + ``</tool_response>``.
* ``verl/workers/agent/envs/mm_process_engine/visual_toolbox_v2.py`` (the ``env_name`` of the published
  training runs, ``examples/agent/final_merged_v1v8_thinklite.sh``, ``agent.max_turns=5``): the answer is the
  last ``<answer>...</answer>``; otherwise only the **last** ``<tool_call>`` of the turn runs;
  ``image_zoom_in_tool`` takes ``bbox_2d`` in pixels of the **original** image (``origin_multi_modal_data``)
  and an optional ``label``; ``image_rotate_tool`` takes ``angle`` (``PIL.Image.rotate``: counter-clockwise,
  canvas kept); both act on the first image. Box validation (``maybe_resize_bbox``/``validate_bbox``): clip to
  the image, then reject unless ``left < right``, ``top < bottom``, the aspect ratio is at most 100 and the
  shorter side is over 30 pixels. Errors come back as a user turn ``Error: <message>`` with the code's messages
  (``Invalid tool call format: ...``, ``ZOOM IN ARGUMENTS ARE INVALID``, ``Unknown tool name: ...``).

Mapping: ``image_zoom_in_tool`` -> vagent ``crop`` (box in original pixels, image 0, cut exactly as accepted);
``image_rotate_tool`` -> ``rotate`` (``expand=False``). Differences: fractional pixel boxes are floored/ceiled
where PIL rounds; a rotation by a multiple of 90 degrees is
vagent's exact transpose (the whole image, its frame turned) where ``PIL.Image.rotate`` keeps the old canvas and
cuts the corners off. DeepEyes saw images at up to
16384x28x28 pixels, so its "original pixels" were its view's pixels: give the policy a pixel budget at
least as large as the images, or its boxes land off target.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.geometry import clamp_box
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "DeepEyesProfile"]

# eval/eval_vstar.py: instruction_prompt_system (identical to PROMPT.SYSTEM_PROMPT_V2 of the training env).
SYSTEM_PROMPT = (
    "You are a helpful assistant.\n\n# Tools\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type":"function","function":{"name":"image_zoom_in_tool","description":"Zoom in on a specific region of an '
    'image by cropping it based on a bounding box (bbox) and an optional object label.","parameters":{"type":'
    '"object","properties":{"bbox_2d":{"type":"array","items":{"type":"number"},"minItems":4,"maxItems":4,'
    '"description":"The bounding box of the region to zoom in, as [x1, y1, x2, y2], where (x1, y1) is the '
    'top-left corner and (x2, y2) is the bottom-right corner."},"label":{"type":"string","description":"The '
    'name or label of the object in the specified bounding box (optional)."}},"required":["bbox"]}}}\n</tools>\n\n'
    "# How to call a tool\nReturn a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
    "**Example**:  \n<tool_call>  \n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 20, 100, 200], "label": "the apple on the desk"}}'
    "  \n</tool_call>"
)
# USER_PROMPT_V2: after the question, and again inside every tool response.
USER_PROMPT = (
    "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  <think>...</think>  "
    "<tool_call>...</tool_call> (if tools needed)  <answer>...</answer> "
)
INVALID_BOX = "ZOOM IN ARGUMENTS ARE INVALID"
MAX_ASPECT = 100  # validate_bbox
MIN_SIDE = 30  # validate_bbox: min(height, width) > 30

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NATIVE = {"image_zoom_in_tool": "crop", "image_rotate_tool": "rotate"}


class DeepEyesProfile:
    """DeepEyes' protocol (see the module docstring)."""

    name = "deepeyes"
    stop_strings: tuple[str, ...] = ()  # its loop reads whole turns (vLLM stops at <|im_end|>)
    inline = False
    limits = AgentLimits(
        max_turns=5, max_images=32, tool_min_pixels=28 * 28
    )  # README: max_vllm_images: 32  # its own checks bound the box; crop it exactly
    tools = ("crop", "rotate")

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        user = Message("user", [*image_parts(images), ContentPart("text", question + USER_PROMPT)])
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        answers = _ANSWER.findall(text)
        if answers and answers[-1]:  # `if answer:` in the env: an empty answer does not end the episode
            turn.answer = answers[-1].strip()
            return turn
        calls = _TOOL_CALL.findall(text)
        if not calls:
            return turn
        if len(calls) > 1:
            turn.errors.append(ParseError("ignored_calls", f"{len(calls) - 1} earlier <tool_call>(s) not run"))
        raw = calls[-1].strip()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            turn.actions = [ParseError("bad_json", f"Invalid tool call format: {raw}. Error: {e}")]
        else:
            if isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("arguments"), dict):
                turn.actions = [ToolCall(data["name"], data["arguments"], raw)]
            else:  # the env indexes tool_call["name"] / ["arguments"]: a KeyError, whose text is the key
                missing = "name" if not isinstance(data, dict) or "name" not in data else "arguments"
                turn.actions = [ParseError("bad_call", repr(missing))]
        turn.errors += [a for a in turn.actions if isinstance(a, ParseError)]
        turn.tool_calls = [a for a in turn.actions if isinstance(a, ToolCall)]
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return _NATIVE.get(call.name)

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._act_one(action, context) for action in parsed.actions]

    def _act_one(self, action: ToolCall | ParseError, context: ToolContext) -> Observation:
        if isinstance(action, ParseError):
            return Observation(text=f"Error: {action.message}", error=action.kind)
        args = action.arguments
        if action.name == "image_zoom_in_tool":
            if "bbox_2d" not in args:
                return Observation(text="Error: 'bbox_2d'", error="bad_arguments")
            box = _deepeyes_box(args["bbox_2d"], context.images[0].size)
            if box is None:
                return Observation(text=f"Error: {INVALID_BOX}", error="bad_box")
            result = run_tool("crop", {"bbox": box, "image_index": 0}, original_context(context, self.limits))
        elif action.name == "image_rotate_tool":
            if "angle" not in args:
                return Observation(text="Error: 'angle'", error="bad_arguments")
            call = {"angle": args["angle"], "image_index": 0, "expand": False}
            result = run_tool("rotate", call, original_context(context, self.limits))
        else:
            return Observation(text=f"Error: Unknown tool name: {action.name}", error="unknown_tool")
        if not result.ok:
            return Observation(text=f"Error: {result.text}", error=result.error, metadata=result.metadata)
        return Observation(text=USER_PROMPT, images=result.images, metadata=result.metadata)

    def observation_message(self, observation: Observation) -> Message:
        if not observation.ok:
            return Message.text("user", observation.text)
        parts = [ContentPart("text", "<tool_response>"), *image_parts(observation.images)]
        return Message("user", [*parts, ContentPart("text", observation.text), ContentPart("text", "</tool_response>")])

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def _deepeyes_box(bbox: object, size: tuple[int, int]) -> list[float] | None:
    """DeepEyes' ``maybe_resize_bbox`` on a box in original pixels: the clipped box, or None when invalid."""
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(isinstance(v, (int, float)) for v in bbox):
        return None
    # clamp_box also pulls a left edge past the right border back to it; the check below fails it either way.
    left, top, right, bottom = clamp_box(bbox, *size)
    if not (left < right and top < bottom):
        return None
    short, long = min(right - left, bottom - top), max(right - left, bottom - top)
    if long / short > MAX_ASPECT or short <= MIN_SIDE:
        return None
    return [left, top, right, bottom]


PROFILE = DeepEyesProfile()
