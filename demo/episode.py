"""What the demo does with one request, without Gradio: check the upload, run the episode on a worker thread,
and turn each turn into chat messages as it arrives.

Guards against: uploads that are too large, not an image or video (a text file renamed ``.png``), corrupt or
truncated, above the pixel limit, or longer than the video limit (``UploadError`` with a message for the user);
questions that are empty or too long; settings outside the allowed range (clamped); an exception anywhere in
the episode (reported as an error event, never raised into the server). Does not guard against: a model that
writes nonsense (that is shown as it is).
"""

from __future__ import annotations

import dataclasses
import html
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageColor, ImageDraw, ImageFont

from vagent.agents import get_profile
from vagent.media import MediaError, load_image, probe_video, read_frames, uniform_timestamps
from vagent.model import Policy
from vagent.rollout import RolloutLimits, Task, rollout
from vagent.rollout.backend import GenerationBackend
from vagent.toolbox import ToolServices
from vagent.types import Message, Observation, Trajectory

__all__ = ["DemoLimits", "Event", "Upload", "UploadError", "annotate", "check_upload", "render_turn", "stream_episode"]

VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v"}
BOX_COLORS = ["#ff2d55", "#00c853", "#2979ff", "#ffab00", "#d500f9", "#00b8d4"]


class UploadError(ValueError):
    """An upload or request the demo refuses; the message is shown to the user as is."""


@dataclass
class DemoLimits:
    """What one request may ask for. Every limit is enforced before the model runs."""

    max_upload_mb: float = 25.0
    max_image_pixels: int = 36_000_000
    max_video_s: float = 300.0
    max_question_chars: int = 2000
    max_turns: int = 8
    max_new_tokens: int = 512
    max_total_tokens: int = 8192
    max_images: int = 40  # video tools return many frames per call


@dataclass
class Upload:
    """A checked upload: an image (decoded, RGB) or a video (its path, length and a few decoded frames)."""

    kind: str  # "image" | "video"
    path: str
    image: Image.Image | None = None
    duration_s: float | None = None
    poster: Image.Image | None = None  # a video's frames side by side (``contact_sheet``)


def check_upload(path: str | Path | None, limits: DemoLimits) -> Upload:
    """Validate an uploaded file, or raise ``UploadError`` saying what is wrong with it."""
    if not path:
        raise UploadError("Upload an image or a video first (or pick one of the examples below).")
    path = Path(path)
    if not path.is_file():
        raise UploadError(f"The upload {path.name} did not arrive; please upload it again.")
    size_mb = path.stat().st_size / 2**20
    if size_mb > limits.max_upload_mb:
        raise UploadError(f"{path.name} is {size_mb:.1f} MB; this demo takes files up to {limits.max_upload_mb:g} MB.")
    if path.suffix.lower() in VIDEO_SUFFIXES:
        try:
            info = probe_video(path)
        except MediaError as e:
            raise UploadError(f"{path.name} is not a readable video: {_without_dir(e, path)}") from None
        if info.duration > limits.max_video_s:
            raise UploadError(
                f"{path.name} is {info.duration:.0f} s long; this demo takes videos up to {limits.max_video_s:g} s."
            )
        try:
            poster = contact_sheet(str(path), info.duration)
        except MediaError as e:
            raise UploadError(f"{path.name} cannot be decoded: {_without_dir(e, path)}") from None
        return Upload("video", str(path), duration_s=info.duration, poster=poster)
    try:
        image = load_image(path, max_pixels=limits.max_image_pixels)
    except MediaError as e:
        raise UploadError(f"{path.name} is not a usable image: {_without_dir(e, path)}") from None
    return Upload("image", str(path), image=image)


def _without_dir(error: Exception, path: Path) -> str:
    """The error's message with the server's upload path cut down to the file name (users need not see it)."""
    return str(error).replace(str(path), path.name)


def build_task(upload: Upload, question: str, tools: list[str], limits: DemoLimits) -> Task:
    question = (question or "").strip()
    if not question:
        raise UploadError("Type a question about the image or video.")
    if len(question) > limits.max_question_chars:
        raise UploadError(f"The question has {len(question)} characters; the limit is {limits.max_question_chars}.")
    if upload.kind == "image":
        return Task(id="demo", question=question, images=[upload.image], tools=list(tools))
    return Task(id="demo", question=question, videos=[upload.path], tools=list(tools))


def clamp_limits(limits: DemoLimits, temperature: float, max_turns: int, max_new_tokens: int) -> RolloutLimits:
    """The episode's limits: the user's settings, held inside the demo's."""
    return RolloutLimits(
        max_turns=max(1, min(int(max_turns), limits.max_turns)),
        max_new_tokens=max(8, min(int(max_new_tokens), limits.max_new_tokens)),
        max_total_tokens=limits.max_total_tokens,
        max_images=limits.max_images,
        temperature=max(0.0, min(float(temperature), 2.0)),
    )


@dataclass
class Event:
    """One thing that happened in the episode, in order.

    ``kind`` is ``"turn"`` (``message``, and ``observation`` for tool turns), ``"done"`` (``trajectory``) or
    ``"error"`` (``error``: a message for the user). ``seconds`` is the time since the previous event.
    """

    kind: str
    seconds: float
    message: Message | None = None
    observation: Observation | None = None
    trajectory: Trajectory | None = None
    error: str | None = None


_POLICY_LOCK = threading.Lock()  # one episode on the model at a time, whatever the server's concurrency


def close_backend(backend: GenerationBackend | None, wait_s: float = 10.0) -> None:
    """Shut down the demo's engine (``--backend vllm``) once the episode on it, if any, has ended (at most ``wait_s``
    seconds: at exit, an episode still running loses its engine and ends with an error)."""
    if backend is None:
        return
    taken = _POLICY_LOCK.acquire(timeout=wait_s)
    try:
        backend.close()
    finally:
        if taken:
            _POLICY_LOCK.release()


def stream_episode(policy: Policy, task: Task, limits: RolloutLimits, services: ToolServices | None = None,
                   seed: int | None = None, agent: str = "vagent",
                   backend: GenerationBackend | None = None) -> Iterator[Event]:  # fmt: skip
    """Run ``task`` on a worker thread and yield its turns as they happen, then ``done`` (or ``error``).
    ``agent`` names the protocol the policy speaks (``vagent.agents.PROFILES``); ``backend`` generates (default:
    vagent's HF engine; ``vagent demo --backend vllm`` passes its vLLM engine). ``seed`` fixes every sampled turn
    (``RolloutLimits.sampling_seed``), on either backend."""
    if seed is not None:
        limits = dataclasses.replace(limits, sampling_seed=int(seed))
    events: queue.Queue[tuple[str, Any, Any]] = queue.Queue()

    def work() -> None:
        try:
            with _POLICY_LOCK:
                trajectory = rollout(policy, task, limits, on_turn=lambda m, o: events.put(("turn", m, o)),
                                     agent=agent, services=services, backend=backend)  # fmt: skip
            events.put(("done", trajectory, None))
        except Exception as e:  # the user sees what failed; the server keeps serving
            events.put(("error", f"{type(e).__name__}: {e}", None))

    threading.Thread(target=work, name="vagent-demo-episode", daemon=True).start()
    last = time.perf_counter()
    while True:
        kind, a, b = events.get()
        now = time.perf_counter()
        seconds, last = now - last, now
        if kind == "turn":
            yield Event("turn", seconds, message=a, observation=b)
        elif kind == "done":
            yield Event("done", seconds, trajectory=a)
            return
        else:
            yield Event("error", seconds, error=a)
            return


# -- rendering --------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return html.escape(str(value))


def describe_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a sentence, e.g. ``crop image 0 at [10, 20, 90, 80]``."""
    args = dict(arguments)
    if name in ("crop", "zoom_in") and "bbox" in args:
        where = f"image {args.pop('image_index', 0)} at {_fmt(args.pop('bbox'))}"
        extra = ", ".join(f"{k} {_fmt(v)}" for k, v in args.items())
        return f"{name} {where}" + (f" ({extra})" if extra else "")
    if name == "code" and "code" in args:
        return "run Python in the sandbox:\n\n```python\n" + str(args["code"]).strip() + "\n```"
    if name == "search" and "query" in args:
        return f"search the web for “{html.escape(str(args['query']))}”"
    return f"{name}(" + ", ".join(f"{k}={_fmt(v)}" for k, v in args.items()) + ")"


def render_turn(event: Event, turn: int, agent: str = "vagent") -> list[dict[str, Any]]:
    """Chat messages (Gradio's ``messages`` format: ``role`` and ``content``) of one turn: the reasoning with
    the turn's tokens and time, each tool call as a sentence, the answer; for a tool turn its text and images.

    Images are returned as PIL images under ``content`` (with a ``caption``); the app makes them components.
    """
    message = event.message
    assert message is not None
    if message.role == "assistant":
        parsed = get_profile(agent).parse(message.plain_text)
        tokens = sum(message.sampled or []) or len(message.token_ids or [])
        thought = parsed.think
        if thought is None and not parsed.actions and parsed.answer is None:
            thought = message.plain_text.strip()  # no tags at all: show what the model wrote
        header = f"**Turn {turn}** · {tokens} tokens · {event.seconds:.1f} s"
        out: list[dict[str, Any]] = [{"role": "assistant", "content": f"{header}\n\n{_quote(thought)}"}]
        for action in parsed.actions:
            if hasattr(action, "arguments"):
                text = f"**Tool call →** {describe_call(action.name, action.arguments)}"
            else:
                text = f"**Malformed tool call ({action.kind}):** {html.escape(action.message)}"
            out.append({"role": "assistant", "content": text})
        if parsed.answer is not None:
            out.append({"role": "assistant", "content": f"**Answer:** {html.escape(parsed.answer) or '*(empty)*'}"})
        return out
    observation = event.observation
    failed = observation is not None and observation.error
    header = f"**{'Tool error' if failed else 'Tool result'}** · {event.seconds:.1f} s"
    stamps = observation.timestamps if observation is not None and observation.timestamps else []
    images = message.images
    first = observation.first_image if observation is not None else None  # the index the engine gave its images
    returned = ["returned image" if first is None else f"returned image {first + k}" for k in range(len(images))]
    captions = [f"frame at {stamps[k]:.2f} s" if k < len(stamps) else returned[k] for k in range(len(images))]
    listed = "".join(
        f"\n\n*{c} ({img.width}x{img.height} px, as the model saw it)*" for c, img in zip(captions, images, strict=True)
    )
    said = observation.text if observation is not None else message.plain_text  # without the per-frame labels
    text = f"{header}\n\n{html.escape(said.strip())}" + (listed if len(images) <= 2 else "")
    out = [{"role": "assistant", "content": text}]
    if len(images) > 2:  # a video tool's frames: one labelled grid instead of a message per frame
        labels = [f"{stamps[k]:.2f}s" if k < len(stamps) else str(k) for k in range(len(images))]
        return [*out, {"role": "assistant", "content": grid(images, labels), "caption": f"{len(images)} frames"}]
    for caption, image in zip(captions, images, strict=True):
        out.append({"role": "assistant", "content": for_display(image), "caption": caption})
    return out


def grid(images: list[Image.Image], labels: list[str], columns: int = 4, height: int = 180) -> Image.Image:
    """Images as a labelled grid, ``columns`` to a row, each scaled to ``height`` px (frames of one video share a
    shape, so the first one's sets the cell width), 4 px apart."""
    width = max(1, round(images[0].width * height / images[0].height))
    rows = -(-len(images) // columns)
    sheet = Image.new("RGB", (columns * (width + 4) - 4, rows * (height + 4) - 4), "white")
    draw = ImageDraw.Draw(sheet)
    for k, (image, label) in enumerate(zip(images, labels, strict=True)):
        left, top = (k % columns) * (width + 4), (k // columns) * (height + 4)
        sheet.paste(image.resize((width, height)), (left, top))
        draw.text((left + 4, top + 4), label, fill="white", stroke_width=2, stroke_fill="black")
    return sheet


def for_display(image: Image.Image, min_side: int = 224) -> Image.Image:
    """Small tool outputs (a 56-px crop) blown up with nearest-neighbour, so people see the pixels the model saw."""
    scale = min_side / max(image.size)
    if scale <= 1:
        return image
    return image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.NEAREST)


def _quote(text: str | None) -> str:
    """Reasoning as a Markdown quote (kept apart from the calls and answer), or a note that there was none."""
    if not text or not text.strip():
        return "*(no reasoning written)*"
    return "\n".join("> " + html.escape(line) for line in text.strip().splitlines())


def annotate(image: Image.Image, boxes: list[list[float]], max_side: int = 1024) -> Image.Image:
    """A copy of ``image`` (shrunk to ``max_side``) with each box (original pixels) drawn and numbered."""
    scale = min(1.0, max_side / max(image.size))
    shown = (
        image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        if scale < 1
        else image.copy()
    )
    draw = ImageDraw.Draw(shown)
    width = max(2, round(max(shown.size) / 200))
    font = ImageFont.load_default(size=max(12, round(max(shown.size) / 30)))
    for k, box in enumerate(boxes):
        x1, y1, x2, y2 = (v * scale for v in box)
        color = BOX_COLORS[k % len(BOX_COLORS)]
        draw.rectangle((x1, y1, x2, y2), outline=color, width=width)
        label = draw.textbbox((x1, y1), str(k + 1), font=font)  # the call's number on a tab above the box
        tab = (x1, max(0, y1 - (label[3] - label[1]) - 2 * width), x1 + (label[2] - label[0]) + 2 * width, y1)
        draw.rectangle(tab, fill=color)
        draw.text((tab[0] + width, tab[1]), str(k + 1), fill="white", font=font)
    return shown


@dataclass
class Looked:
    """Where the policy looked: for an image, the crop and zoom boxes on it (crops of a crop are not drawn); for
    a video (``duration`` set), the span and frame times of each video-tool call."""

    image: Image.Image | None = None
    boxes: list[list[float]] = field(default_factory=list)  # original pixels of ``image``
    duration: float | None = None
    spans: list[tuple[list[float], list[float]]] = field(default_factory=list)  # (span, frame times) per call

    def add(self, observation: Observation | None) -> None:
        metadata = observation.metadata if observation is not None else {}
        if "box_original" in metadata and int(metadata.get("image_index", 0)) == 0:
            self.boxes.append(list(metadata["box_original"]))
        if "span" in metadata:
            self.spans.append((list(metadata["span"]), list(metadata.get("timestamps", []))))

    def picture(self) -> Image.Image | None:
        """The prompt image with the boxes drawn on it, or for a video its timeline with the sampled spans."""
        if self.duration is not None:
            return timeline(self.duration, self.spans)
        return annotate(self.image, self.boxes) if self.image is not None else None


def timeline(duration: float, spans: list[tuple[list[float], list[float]]], width: int = 960) -> Image.Image:
    """A video's time axis with one numbered row per video-tool call: its span shaded, a tick per frame it took."""
    row, pad = 34, 40
    image = Image.new("RGB", (width, pad + row * max(1, len(spans)) + 10), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    x = lambda t: pad + (width - 2 * pad) * min(max(t / max(duration, 1e-6), 0.0), 1.0)  # noqa: E731
    draw.line((x(0), 24, x(duration), 24), fill="#444", width=2)
    for k in range(11):
        t = duration * k / 10
        draw.line((x(t), 20, x(t), 28), fill="#444", width=1)
        draw.text((x(t) - 10, 2), f"{t:.1f}s", fill="#444", font=font)
    for k, (span, times) in enumerate(spans):
        top, color = pad + row * k, BOX_COLORS[k % len(BOX_COLORS)]
        tint = tuple(round(255 - (255 - c) * 0.25) for c in ImageColor.getrgb(color))  # the span light, frames dark
        draw.rectangle((x(span[0]), top, max(x(span[1]), x(span[0]) + 2), top + row - 10), fill=tint, outline=color)
        for t in times:
            draw.line((x(t), top, x(t), top + row - 10), fill=color, width=2)
        draw.text((4, top + 2), str(k + 1), fill=color, font=font)
    if not spans:
        draw.text((pad, pad), "no frames sampled yet", fill="#888", font=font)
    return image


def contact_sheet(path: str, duration: float, frames: int = 4, height: int = 120) -> Image.Image:
    """``frames`` evenly spaced frames of a video side by side with their times (how an uploaded video is shown)."""
    images, times = read_frames(path, uniform_timestamps(0.0, duration, frames))
    return grid(images, [f"{t:.1f}s" for t in times], columns=len(images), height=height)
