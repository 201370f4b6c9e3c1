"""``thyme``: Thyme (yfzhang114/Thyme), "think beyond images": the model writes Python that crops, rotates or
enhances the image (or computes), run in a sandbox.

Taken from the agent's own code (github.com/yfzhang114/Thyme):

* ``eval/utils.py`` (``run_evaluation``, the published inference script ``eval/inference.py``) and its VLMEvalKit
  model ``eval/VLMEvalKit/vlmeval/vlm/thyme/{model,utils}.py``: the system prompt (``SYSTEM_PROMPT`` =
  ``REASONING_SYS_PROMPT``, also ``scripts/prompt.txt``); the user turn: the image, then ``generate_prompt_final_qa``
  (``"<image>\\n{question}"``, the user image's path and size, the output format); generation stops at ``</code>`` or
  ``</answer>`` (``SPECIAL_STRING_LIST``); a piece with ``</answer>`` is final; otherwise the first
  ``<code> ```python ... ``` </code>`` block runs; ``MAX_ITERATIONS = 5`` pieces (``max_iterations=5`` in
  ``vlmeval/config.py``), 2048 new tokens each; the answer is the ``<answer>`` text, or the last ``\\boxed{}`` in it.
* ``swift/trainers/sandbox.py`` (= ``vlmeval/vlm/thyme/sandbox.py``, ``execute_code_in_sandbox``): the code gets
  ``image_path`` (the user image) and ``temp_output_dir``; an assignment ``image_path = "<path>"`` whose path is not
  an image on disk is pointed at the user image; ``cv``/``cv3``/``cv4``/``CV`` attribute access becomes ``cv2``;
  the first line takes the second's indentation, then the code is dedented; ``/mnt/data/temp_processed_images/`` is
  the output folder; ``:.Nf}`` formats print 8 decimals; code matching its "dangerous" patterns is refused; errors
  read ``Sandbox for N/A: ...`` (``item_id`` defaults to ``N/A``); 10 s limit (``EXEC_TIME_LIMIT``). The images it
  wrote come back, else its printed output as text.
* ``swift/trainers/rlhf_trainer/grpo_trainer.py`` (``process_round``, the RL loop): the result is written
  ``<sandbox_output>`` + images (or the printed text, or the error message, or ``Sandbox for ...: No output
  captured.``) + ``</sandbox_output>``; ``scripts/rl.sh``: ``--vllm_limit_mm_per_prompt '{"image": 6}'``.

Mapping: python -> vagent ``code`` on the episode's images (the user image is the sandbox's ``image_0.png``, and the
prompt names that file as the user image's path; the output folder is the sandbox's working directory, whose new
images come back). Differences: Thyme puts ``<sandbox_output>`` (images included) **inside the assistant turn**
and lets the model continue it; vagent's encoder carries images only in non-assistant turns, so the turn ends at
``</code>`` and the result is a user turn with the same text. Thyme's evaluation loop silently drops a piece whose
code gave nothing and samples again (and retries a whole failed episode 5 times, then asks without tools); vagent
shows the error inside ``<sandbox_output>`` as its RL loop does, and a piece with neither code nor answer ends the
episode. Not applied: the 2048-token piece cap (``MAX_NEW_TOKENS``; pass ``--max-new-tokens 2048``), ``autopep8``,
the clamping of literal crop boxes (``CropCoordinateTransformer``), the restricted builtins, variables kept between
calls (each call runs fresh), subfolders of the output folder. Error texts take the exception from the sandbox's
stderr (``ExcType: message``), close to Thyme's ``str(e)``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, last_boxed, run_tool
from vagent.chat import ParsedTurn
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "ThymeProfile"]

SYSTEM_PROMPT = (
    "You are a helpful assistant.\n\nSolve the following problem step by step, and optionally write Python code for "
    "image manipulation to enhance your reasoning process. The Python code will be executed by an external sandbox, "
    "and the processed image or result (wrapped in <sandbox_output></sandbox_output>) can be returned to aid your "
    "reasoning and help you arrive at the final answer.\n\n**Reasoning & Image Manipulation (Optional but "
    "Encouraged):**\n    * You have the capability to write executable Python code to perform image manipulations "
    "(e.g., cropping to a Region of Interest (ROI), resizing, rotation, adjusting contrast) or perform calculation for "
    "better reasoning.\n    * The code will be executed in a secure sandbox, and its output will be provided back to "
    "you for further analysis.\n    * All Python code snippets **must** be wrapped as follows:\n    <code>\n    "
    "```python\n    # your code.\n    ```\n    </code>\n    * At the end of the code, print the path of the processed "
    "image (processed_path) or the result for further processing in a sandbox environment."
)
USER_PROMPT = (
    '<image>\n{question}\n\n### User Image Path:** "{path}"\n### User Image Size:** "{size}"\n\n### **Output Format '
    "(strict adherence required):**\n\n<think>Your detailed reasoning process, including any code, should go "
    "here.</think>\n<answer>Your final answer to the user's question goes here.</answer>\n"
)
USER_IMAGE = "image_0.png"  # the sandbox's file of the user image (vagent's code tool), shown as its path
OUTPUT_DIR = "/mnt/data/temp_processed_images/"  # the output folder its prompts and data use
OPEN, CLOSE, IMAGE = "<sandbox_output>", "</sandbox_output>", "<image>"
ITEM = "Sandbox for N/A"  # execute_code_in_sandbox(item_id="N/A")
EXEC_TIME_LIMIT = 10
MAX_NEW_TOKENS = 2048  # MAX_NEW_TOKENS_PER_STEP (not an AgentLimits field: pass --max-new-tokens)

_CODE = re.compile(r"<code>\s*(?:```\s*)?(?:python\s*)?([\s\S]*?)\s*(?:```\s*)?</code>", re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DANGEROUS = re.compile(
    r"\bsys\.|\bsocket\.|\bsubprocess\.|\bexec\(|\beval\(|\bcompile\(|\b__import__\(|\bos\.(remove|unlink|rmdir)\b"
    r"|\bshutil\.rmtree\b|\bshutil\.move\b|\bos\.(rename|renames)\b",
    re.IGNORECASE,
)
_CV_ALIASES = {"cv", "cv3", "cv4", "CV"}
# What its sandbox puts in the code's namespace, then its two variables.
_PRELUDE = f"""\
import os, random, string, math, json, re
import numpy
import numpy as np
from PIL import Image
try:
    import cv2
except ImportError:
    pass
image_path = os.path.abspath("{USER_IMAGE}")
temp_output_dir = os.getcwd()
"""


class ThymeProfile:
    """Thyme's protocol (see the module docstring)."""

    name = "thyme"
    stop_strings: tuple[str, ...] = ("</code>", "</answer>")  # SPECIAL_STRING_LIST
    inline = False  # Thyme continues the assistant turn; see the module docstring
    limits = AgentLimits(max_turns=5, max_images=6)  # MAX_ITERATIONS = 5; rl.sh: limit_mm_per_prompt image 6
    tools = ("code",)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        text = USER_PROMPT.format(question=question, path=USER_IMAGE, size=_size(images[0]) if images else "")
        user = Message("user", [*image_parts(images), ContentPart("text", text)])
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if "</answer>" in text:
            answer = _ANSWER.search(text)
            if answer is not None:
                turn.answer = answer.group(1).strip()
                if "\\boxed{" in turn.answer:  # "still wrapped in \boxed{}": the last one, to its brace or the end
                    turn.answer = last_boxed(turn.answer) or turn.answer.split("\\boxed{")[-1]
            return turn
        code = _CODE.search(text)
        if code is not None:
            call = ToolCall("python", {"code": code.group(1).strip()}, code.group(0))
            turn.actions, turn.tool_calls = [call], [call]
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return "code" if call.name == "python" else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._run(a.arguments["code"], context) for a in parsed.actions if isinstance(a, ToolCall)]

    def _run(self, code: str, context: ToolContext) -> Observation:
        if _DANGEROUS.search(code):
            message = f"{ITEM}: Code contains potentially dangerous system operations such as remove. Execution denied."
            return _result(message, "refused")
        result = run_tool("code", {"code": _PRELUDE + thyme_code(code)}, context)
        if result.error == "timeout":
            return _result(f"{ITEM}: Execution timed out after {EXEC_TIME_LIMIT} seconds.", "timeout", result.metadata)
        if result.error is not None:
            return _result(_failure(result.metadata.get("stderr", ""), result.text), result.error, result.metadata)
        if result.images:
            return Observation(text=OPEN + IMAGE * len(result.images) + CLOSE, images=result.images,
                               metadata=result.metadata)  # fmt: skip
        printed = result.metadata.get("stdout", "").strip()
        if printed:
            return _result(printed, None, result.metadata)
        return _result(f"{ITEM}: No output captured.", "no_output", result.metadata)

    def observation_message(self, observation: Observation) -> Message:
        """A user turn; the images sit where the text has ``<image>`` (inside ``<sandbox_output>``)."""
        pieces = observation.text.split(IMAGE)
        parts = [ContentPart("text", pieces[0])]
        for image, piece in zip(observation.images, pieces[1:], strict=False):
            parts += [*image_parts([image]), *([ContentPart("text", piece)] if piece else [])]
        return Message("user", parts)

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def thyme_code(code: str) -> str:
    """The model's code as Thyme's sandbox rewrites it before running it (see the module docstring).

    >>> thyme_code('image_path = "/data/q/1.jpg"\\nprint(cv.imread(image_path).shape)')
    "image_path = 'image_0.png'\\nprint(cv2.imread(image_path).shape)"
    """
    lines = code.splitlines()
    shown = [i for i, line in enumerate(lines) if line.strip()][:2]
    if len(shown) == 2:  # the first line takes the second's indentation (align_first_line_to_second)
        first, second = (lines[i] for i in shown)
        lines[shown[0]] = " " * (len(second) - len(second.lstrip(" "))) + first.lstrip(" ")
    code = textwrap.dedent("\n".join(lines)).strip()
    try:
        tree = ast.parse(code)
    except SyntaxError:
        pass  # runs as written, and fails as written
    else:
        rewrite = _Rewrite()
        rewrite.visit(tree)
        code = ast.unparse(tree) if rewrite.changed else code
    code = code.replace(OUTPUT_DIR, "./")  # its output folder is the sandbox's working directory
    return re.sub(r":\.\d{1}f}", ":.8f}", code)


class _Rewrite(ast.NodeTransformer):
    """``image_path = "<str>"`` -> the user image (no host path exists in the sandbox); ``cv.x`` -> ``cv2.x``."""

    changed = False

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        target, value = node.targets[0], node.value
        if len(node.targets) == 1 and isinstance(target, ast.Name) and target.id == "image_path":
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.value, self.changed = ast.Constant(USER_IMAGE), True
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in _CV_ALIASES:
            node.value.id, self.changed = "cv2", True
        return self.generic_visit(node)


def _result(text: str, error: str | None, metadata: dict | None = None) -> Observation:
    return Observation(text=OPEN + text + CLOSE, error=error, metadata=metadata or {})


def _failure(stderr: str, fallback: str) -> str:
    """Thyme's message for an exception, from the last line of a traceback (``ExcType: message``)."""
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    kind, sep, message = last.partition(": ")
    kind = kind.rsplit(".", 1)[-1]  # "PIL.UnidentifiedImageError" -> its class name
    if not sep or not kind.isidentifier():
        return f"{ITEM}: Code execution failed: {fallback}"
    if kind in ("ImportError", "ModuleNotFoundError"):
        return (f"{ITEM}: Code execution failed due to ImportError. Ensure all required modules are available and "
                f"correctly named: {message}")  # fmt: skip
    if kind == "MemoryError":
        why = "The operation likely consumed too much memory"
        return f"{ITEM}: Code execution failed due to MemoryError. {why}: {message}"
    if kind in ("SyntaxError", "IndentationError", "TabError"):
        return f"{ITEM}: Code execution failed due to SyntaxError: {message}"
    return f"{ITEM}: Code execution failed: {message}"


def _size(image: Image.Image | str) -> str:
    """``WxH`` of the user image, or Thyme's words when it cannot be read."""
    try:
        if isinstance(image, Image.Image):
            return f"{image.width}x{image.height}"
        with Image.open(image) as opened:
            return f"{opened.width}x{opened.height}"
    except OSError:
        return "Unable to determine (error reading image)"


PROFILE = ThymeProfile()
