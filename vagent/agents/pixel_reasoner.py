"""``pixel-reasoner``: Pixel-Reasoner (TIGER-AI-Lab/Pixel-Reasoner), pixel-space reasoning with curiosity-driven RL.

Taken from the agent's own code (github.com/TIGER-AI-Lab/Pixel-Reasoner):

* ``curiosity_driven_rl/openrlhf/trainer/ppo_utils/experience_maker.py``: the tools ``crop_image_normalized``
  (``bbox_2d`` as 0-1 fractions of the raw image, grown by 0.1 on every side and clipped; a box with any
  number >= 1 is read as pixels of that image and padded the same way; the crop must be over 28x28 pixels)
  with ``target_image`` (1-based over the prompt's originals, then the returned images) and
  ``select_frames`` (1-based ``target_frames``, at most 8, of the video's frames); the system prompt
  (``"You are a helpful assistant."`` + qwen-agent's ``NousFnCallPrompt`` tool block, ``FN_CALL_TEMPLATE``
  in QwenLM/Qwen-Agent ``qwen_agent/llm/fncall_prompts/nous_fncall_prompt.py``); the loop: a turn that ends
  with ``</tool_call>`` runs its **last** call, any other turn is final; at most 4 calls (``num_toolcalls > 3``
  force-terminates), 16 images; results as a user turn ``"\\nHere is the cropped image (Image Size: WxH):"`` +
  image, ``"\\nHere are the selected frames (Frame Size: WxH, Numbered a to b):"`` + frames, or
  ``"\\nExecution error:\\n<message>\\n"``; crops resized to 256x28x28..5120x28x28 pixels (evaluation settings).
* ``curiosity_driven_rl/openrlhf/datasets/prompts_dataset.py``: the user text is the question + ``"\\n\\n"`` +
  the ``vcot`` guidelines; the answer is the last ``\\boxed{}``.
* TIGER-AI-Lab/verl-tool ``verl_tool/servers/tools/pixel_reasoner.py``: the ``crop_image`` variant (pixel boxes
  read by the same rule); here it is an alias of ``crop_image_normalized`` with Pixel-Reasoner's wording.

Mapping: crops -> vagent ``crop`` (box converted by ``geometry.normalized_to_original``); ``select_frames`` ->
the prompt's video frames (Pixel-Reasoner gives the model 16 frames of a video; so does this profile, as
images). Differences: vagent floors/ceils a fractional pixel box where PIL rounds it (at most 1 pixel).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, last_boxed, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.geometry import normalized_to_original, pixels_as_fractions
from vagent.media import MediaError, probe_video, read_frames, smart_resize, uniform_timestamps
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "PixelReasonerProfile"]

TOOL_END, TOOL_START = "</tool_call>", "<tool_call>"
PADDING = 0.1
MIN_SIDE = 28  # assert w > 28 and h > 28
MAX_SELECT = 8
VIDEO_FRAMES = 16  # "Frame index from 1 to 16."
CROP_MIN_PIXELS, CROP_MAX_PIXELS = 256 * 28 * 28, 5120 * 28 * 28  # resize_cropped when is_eval

_TOOLS = [
    {
        "name": "crop_image_normalized",
        "description": "Zoom in on the image based on the bounding box coordinates. It is useful when the object or "
        "text in the image is too small to be seen.",
        "parameters": {
            "type": "object",
            "properties": {
                "bbox_2d": {
                    "type": "array",
                    "description": "coordinates for bounding box of the area you want to zoom in. Values should be "
                    "within [0.0,1.0].",
                    "items": {"type": "number"},
                },
                "target_image": {
                    "type": "number",
                    "description": "The index of the image to crop. Index from 1 to the number of images. Choose 1 to "
                    "operate on original image.",
                },
            },
            "required": ["bbox_2d", "target_image"],
        },
    },
    {
        "name": "select_frames",
        "description": "Select frames from a video.",
        "parameters": {
            "type": "object",
            "properties": {
                "target_frames": {
                    "type": "array",
                    "description": "List of frame indices to select from the video (no more than 8 frames in total).",
                    "items": {"type": "integer", "description": "Frame index from 1 to 16."},
                }
            },
            "required": ["target_frames"],
        },
    },
]
# qwen-agent FN_CALL_TEMPLATE, appended to the system text after "\n\n".
SYSTEM_PROMPT = (
    "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in _TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
# prompts_dataset.py: trigger = f"\n\n{templates['vcot']}" and vcot itself starts with "\n\n".
GUIDELINES = (
    "\n\n\n\nGuidelines: Understand the given visual information and the user query. Determine if it is beneficial "
    "to employ the given visual operations (tools). For a video, we can look closer by `select_frames`. For an image, "
    "we can look closer by `crop_image`. Reason with the visual information step by step, and put your final answer "
    "within \\boxed{}."
)
_CROPS = ("crop_image_normalized", "crop_image", "zoom_in")


class PixelReasonerProfile:
    """Pixel-Reasoner's protocol (see the module docstring)."""

    name = "pixel-reasoner"
    stop_strings: tuple[str, ...] = ()  # vLLM stops at <|im_end|>; '</tool_call>' is commented out in its stops
    inline = False
    limits = AgentLimits(
        max_turns=5, max_images=16, max_calls=4, tool_max_pixels=CROP_MAX_PIXELS, tool_min_pixels=28 * 28
    )
    tools = ("crop",)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        if frames is not None and videos:  # select_frames numbers these 16 frames; no tool shows the others
            raise ValueError(
                "a frame budget does not apply to pixel-reasoner: its select_frames only re-shows the "
                f"{VIDEO_FRAMES} frames of its prompt, so a smaller first view would hide frames for good"
            )
        shown = list(images) + [frame for path in videos[:1] for frame in _video_frames(path)]
        user = Message("user", [*image_parts(shown), ContentPart("text", question + GUIDELINES)])
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if not text.endswith(TOOL_END):  # require_tool: the turn must end with the call; anything else is final
            turn.answer = last_boxed(text)
            return turn
        raw = text.split(TOOL_START)[-1].split(TOOL_END)[0]  # parse_last_tool
        try:
            data = json.loads(raw)
            call = ToolCall(data["name"], data["arguments"], raw.strip())
            if not isinstance(call.arguments, dict):
                raise TypeError("the arguments must be a JSON object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            turn.actions = [ParseError("bad_json" if isinstance(e, json.JSONDecodeError) else "bad_call", str(e))]
            turn.errors = list(turn.actions)
            return turn
        turn.actions, turn.tool_calls = [call], [call]
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return "crop" if call.name in _CROPS else "select_frames" if call.name == "select_frames" else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        out = []
        for action in parsed.actions:
            if isinstance(action, ParseError):
                out.append(_error(action.message, action.kind))
            elif action.name == "select_frames":
                out.append(self._select(action.arguments, context))
            elif action.name in _CROPS:
                out.append(self._crop(action.arguments, context))
            else:
                out.append(_error(repr(action.name), "unknown_tool"))  # self.operations[tool_name]: KeyError
        return out

    def _crop(self, args: dict, context: ToolContext) -> Observation:
        if "bbox_2d" not in args or "target_image" not in args:
            return _error(repr("bbox_2d" if "bbox_2d" not in args else "target_image"), "bad_arguments")
        index = _crop_index(args["target_image"], context)
        if isinstance(index, Observation):
            return index
        bbox = args["bbox_2d"]
        if not isinstance(bbox, list) or len(bbox) != 4 or not all(isinstance(v, (int, float)) for v in bbox):
            return _error(f"bbox_2d must be 4 numbers, got {bbox!r}", "bad_box")
        size = context.images[index].size
        fractions = bbox if all(v < 1 for v in bbox) else pixels_as_fractions(bbox, size)
        box = normalized_to_original(fractions, size, (PADDING, PADDING))
        width, height = round(box[2]) - round(box[0]), round(box[3]) - round(box[1])  # PIL rounds the crop box
        if not (width > MIN_SIDE and height > MIN_SIDE):
            return _error(f"Cropped image is too small: {width}x{height}", "bad_box")
        result = run_tool("crop", {"bbox": list(box), "image_index": index}, original_context(context, self.limits))
        if not result.ok:
            return _error(result.text, result.error or "tool_exception")
        h, w = smart_resize(height, width, min_pixels=CROP_MIN_PIXELS, max_pixels=CROP_MAX_PIXELS)
        image = result.images[0]
        image = image if image.size == (w, h) else image.resize((w, h), Image.Resampling.BICUBIC)
        text = f"\nHere is the cropped image (Image Size: {w}x{h}):"
        return Observation(text=text, images=[image], metadata=result.metadata)

    def _select(self, args: dict, context: ToolContext) -> Observation:
        if not context.videos:
            return _error("Execution Error: You attempted to `select_frames` from **image** not **video**. You should "
                          "use `crop_image_normalized` instead for inspecting **image**.", "bad_arguments")  # fmt: skip
        if "target_frames" not in args:
            return _error(repr("target_frames"), "bad_arguments")
        target = args["target_frames"]
        if not isinstance(target, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in target):
            return _error(f"target_frames must be a list of integers, got {target!r}", "bad_arguments")
        if len(target) > MAX_SELECT:
            return _error(f"Execution Error: You have selected {len(target)} frames in total. Think again which "
                          "frames you need to check in details (no more than 8 frames)", "bad_arguments")  # fmt: skip
        frames = context.images[:VIDEO_FRAMES]
        if not target or max(target) > len(frames) or min(target) < 1:
            return _error(f"Execution Error: There are {len(frames)} frames numbered in range [1,{len(frames)}]. Your "
                          f"selection `target_frames={target}` is out of range.", "bad_arguments")  # fmt: skip
        picked = [frames[t - 1] for t in target]
        first = 1 + len(context.images) - VIDEO_FRAMES  # Pixel-Reasoner counts the whole video as one item
        w, h = picked[0].size
        text = f"\nHere are the selected frames (Frame Size: {w}x{h}, Numbered {first} to {len(picked) + first - 1}):"
        return Observation(text=text, images=picked, metadata={"target_frames": target})

    def observation_message(self, observation: Observation) -> Message:
        return Message("user", [ContentPart("text", observation.text), *image_parts(observation.images)])

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def _error(message: str, kind: str) -> Observation:
    return Observation(text=f"\nExecution error:\n{message}\n", error=kind)


def _crop_index(target: object, context: ToolContext) -> int | Observation:
    """The context index of a 1-based ``target_image`` (Pixel-Reasoner's rules for images and videos)."""
    if not isinstance(target, (int, float)) or isinstance(target, bool) or int(target) != target:
        return _error(f"target_image must be an integer, got {target!r}", "bad_arguments")
    tgt = int(target)
    if context.videos:  # images = [video, returned images...]
        returned = len(context.images) - VIDEO_FRAMES
        if returned == 0:
            if not 1 <= tgt <= VIDEO_FRAMES:
                return _error("Execution Error: Incorrect `target_image` argument in `crop_image_normalized` operation. "
                              f"You can only pick an image **from** the video within [1,{VIDEO_FRAMES}], but the "
                              f"current argument `target_image={tgt}`.", "bad_arguments")  # fmt: skip
            return tgt - 1
        if not 2 <= tgt <= returned + 1:
            return _error("Execution Error: Incorrect `target_image` argument in `crop_image_normalized` operation. "
                          f"You can only pick an image within range [2,{returned + 1}], but the current argument "
                          f"`target_image={tgt}`.", "bad_arguments")  # fmt: skip
        return VIDEO_FRAMES + tgt - 2
    if not 1 <= tgt <= len(context.images):
        return _error("Execution Error: Incorrect `target_image` argument in `crop_image_normalized` operation. You "
                      f"can only pick an image within [1,{len(context.images)}]", "bad_arguments")  # fmt: skip
    return tgt - 1


def _video_frames(path: str) -> list[Image.Image]:
    """The 16 frames Pixel-Reasoner shows of a video, spread evenly (none when the video cannot be read)."""
    try:
        info = probe_video(path)
        frames, _ = read_frames(path, uniform_timestamps(0.0, info.duration, VIDEO_FRAMES))
    except MediaError:
        return []
    return frames


PROFILE = PixelReasonerProfile()
