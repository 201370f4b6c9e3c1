"""Trajectory export: JSONL for programs, one self-contained HTML page for people.

JSONL: one ``Trajectory.to_dict`` record per line; in-memory images become PNG files (default folder
``<stem>_images/``) referenced by paths relative to the JSONL, so the two move together. ``write_jsonl``
replaces a file atomically; ``JsonlWriter`` appends one complete line per trajectory. HTML: ``write_html``
inlines CSS, a little JS and downscaled base64 images, and escapes all text since model output is untrusted.
Not covered: videos are named, not embedded; huge runs should be shown in slices.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from PIL import Image

from vagent.chat import parse_turn
from vagent.types import ContentPart, Message, ToolCall, Trajectory

__all__ = ["JsonlWriter", "read_jsonl", "save_png_once", "write_html", "write_jsonl"]

PathLike = str | os.PathLike[str]
Extra = Callable[[Trajectory], dict[str, Any]]
_MAX_SIDE = 768  # px of the longest side in the HTML: enough to read a crop, small enough for 200 trajectories
_JPEG_ABOVE = 160 * 160  # pixels above which JPEG is tried too: photos shrink ~5x; small crops stay crisp PNG
_BLOCK = re.compile(r"<(think|tool_call|answer)>(.*?)(?:</\1>|$)", re.DOTALL)  # same blocks as chat.parse_turn


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _relative(path: PathLike, base: Path) -> str:
    """``path`` relative to ``base`` when inside it, else absolute: either way it survives moving the folder."""
    relative = os.path.relpath(path, base)
    return os.path.abspath(path) if relative.startswith("..") else Path(relative).as_posix()


def save_png_once(image: Image.Image, folder: Path, stem: str) -> Path:
    """``image`` as ``folder/{stem}_{digest of its pixels}.png``: equal images share one file, written once and
    atomically, so a reader never sees a torn PNG and a later save never rewrites one being read."""
    digest = hashlib.blake2b(f"{image.mode}{image.size}".encode(), digest_size=8)
    digest.update(image.tobytes())
    target = Path(folder) / f"{stem}_{digest.hexdigest()}.png"
    if not target.exists():
        _replace_atomically(target, lambda tmp: image.save(tmp, format="PNG"))
    return target


def _replace_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)``, then move tmp onto ``path``: readers and a killed run see the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same folder: os.replace is atomic, relative paths hold
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class JsonlWriter:
    """Appends trajectories to a JSONL file, one complete line per ``write``, for runs that must survive a kill.

    Each line goes out in one ``os.write`` on an ``O_APPEND`` descriptor, so earlier lines are never touched
    and each is readable once ``write`` returns; a line that a kill still cut short is dropped when the file
    is opened again. Existing lines are kept: delete the file (or use ``write_jsonl``) to start over.

    Args:
        path: The JSONL file; parent folders are created.
        image_dir: Where in-memory images go as PNG; default ``<path stem>_images/`` next to ``path``. Names are
            ``<sanitized task_id>_<content hash>.png``, so equal images are saved once.
        extra: ``extra(trajectory) -> dict`` of fields to add to each record (e.g. the gold answer); clashes raise.
    """

    def __init__(self, path: PathLike, *, image_dir: PathLike | None = None, extra: Extra | None = None) -> None:
        self.path = Path(path)
        self.image_dir = Path(image_dir) if image_dir is not None else self.path.with_name(f"{self.path.stem}_images")
        self.extra = extra
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab+") as f:  # drop a last line that a killed writer left without its newline
            if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.seek(0)
                f.truncate(sum(len(line) for line in f if line.endswith(b"\n")))  # a full scan, only after a kill
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def record(self, trajectory: Trajectory) -> dict[str, Any]:
        """The JSON record of ``trajectory``, saving its in-memory images (each distinct image once)."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", trajectory.task_id)[:80].strip("._") or "task"
        saved: dict[int, str] = {}  # id(image) -> path; the trajectory keeps its images alive, so ids are stable

        def save(image: Image.Image) -> str:
            if id(image) not in saved:
                # Content-addressed: equal pixels share a file (the prompt image of n samples is saved once),
                # re-exporting is idempotent, and a rewrite never clobbers an image an older JSONL points to.
                saved[id(image)] = _relative(save_png_once(image, self.image_dir, stem), self.path.parent)
            return saved[id(image)]

        record = trajectory.to_dict(save_image=save)
        # Paths the parts already had (dataset inputs, or absolute after read_jsonl) follow the same rule.
        for message, out in zip(trajectory.messages, record["messages"], strict=True):
            for part, part_out in zip(message.content, out["content"], strict=True):
                if part.path is not None:
                    part_out["path"] = _relative(part.path, self.path.parent)
        if self.extra is not None:
            fields = self.extra(trajectory)
            if clash := sorted(fields.keys() & record.keys()):
                raise ValueError(f"extra fields {clash} would overwrite trajectory fields")
            record.update(fields)
        return record

    def write(self, trajectory: Trajectory) -> None:
        """Append ``trajectory`` as one line; it is in the file (OS cache) when this returns."""
        if self._fd is None:
            raise ValueError(f"write to a closed JsonlWriter ({self.path})")
        view = memoryview((json.dumps(self.record(trajectory), ensure_ascii=False) + "\n").encode())
        while view:  # short writes happen only on a full disk or a fatal signal; finish the line if we can
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)  # once per file: a finished export survives a power loss too
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_jsonl(
    trajectories: Iterable[Trajectory], path: PathLike, *, image_dir: PathLike | None = None, extra: Extra | None = None
) -> Path:
    """Write ``trajectories`` to ``path``, one JSON record per line, replacing the file atomically.

    If anything raises on the way (``extra`` included), the previous file, if any, is left untouched.

    Args:
        trajectories: Any iterable; consumed once, one trajectory at a time.
        path: The JSONL file.
        image_dir: As for ``JsonlWriter``: default ``<path stem>_images/``; record paths are relative to ``path``.
        extra: ``extra(trajectory) -> dict`` of fields added to each record (e.g. the gold answer).
    """
    path = Path(path)
    image_dir = Path(image_dir) if image_dir is not None else path.with_name(f"{path.stem}_images")

    def write(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)  # a stale temp file of a killed run must not be appended to
        with JsonlWriter(tmp, image_dir=image_dir, extra=extra) as writer:
            for trajectory in trajectories:
                writer.write(trajectory)

    return _replace_atomically(path, write)


def read_jsonl(path: PathLike) -> list[Trajectory]:
    """Read trajectories back; image and video paths are resolved against the file's folder (pixels load
    lazily) and extra fields are ignored. Raises ``ValueError`` naming ``path:line`` for a bad line."""
    path = Path(path)
    trajectories = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                trajectory = Trajectory.from_dict(json.loads(line))
            except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: not a trajectory record: {e!r}") from e
            for part in (part for message in trajectory.messages for part in message.content):
                if part.path is not None and not os.path.isabs(part.path):
                    part.path = os.path.abspath(path.parent / part.path)
            trajectories.append(trajectory)
    return trajectories


def _data_uri(image: Image.Image) -> str:
    """``image`` downscaled to ``_MAX_SIDE`` as a base64 PNG, or JPEG when that is smaller for a big image."""
    if (scale := _MAX_SIDE / max(image.size)) < 1:
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
    alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    image = image.convert("RGBA" if alpha else "RGB")
    encoded: dict[str, bytes] = {}
    for kind in ("png",) if alpha or image.width * image.height < _JPEG_ABOVE else ("png", "jpeg"):
        buf = io.BytesIO()
        image.save(buf, format=kind, quality=85)  # PNG ignores quality
        encoded[kind] = buf.getvalue()
    kind = min(encoded, key=lambda k: len(encoded[k]))
    return f"data:image/{kind};base64,{base64.b64encode(encoded[kind]).decode()}"


def _image_html(part: ContentPart, cache: dict[Any, str | None]) -> str:
    # Cached by identity / path: the prompt image of n samples is encoded once (the caller holds them: ids stay unique).
    key = ("id", id(part.image)) if part.image is not None else ("path", part.path)
    if key not in cache:
        cache[key] = None  # missing, corrupt or absurd files show a placeholder instead of failing the page
        with contextlib.suppress(OSError, ValueError, Image.DecompressionBombError):
            with Image.open(str(part.path)) if part.image is None else contextlib.nullcontext(part.image) as image:
                cache[key] = _data_uri(image)
    stamps = ", ".join(f"t={t:.2f}s" for t in part.timestamps or [])  # video frames: when each was taken
    caption = stamps and f"<figcaption>{_esc(stamps)}</figcaption>"
    if (uri := cache[key]) is None:
        return f'<figure><div class="missing">image not available<br>{_esc(part.path)}</div>{caption}</figure>'
    return f'<figure><img class="thumb" src="{uri}" alt="image" title="click to enlarge">{caption}</figure>'


def _assistant_html(message: Message) -> str:
    text = message.plain_text
    turn = parse_turn(text)
    out, pos = [], 0
    for match in [*_BLOCK.finditer(text), None]:  # None: the text after the last block
        if loose := text[pos : match.start() if match else None].strip():
            out.append(f'<div class="text">{_esc(loose)}</div>')
        if match is None:
            break
        tag, body, pos = match.group(1), match.group(2).strip(), match.end()
        if tag == "think":
            out.append(f'<div class="think">{_esc(body)}</div>')
        elif tag == "answer":
            out.append(f'<div class="answer">answer: {_esc(body)}</div>')
        else:  # parse the block alone, with the grammar's own parser, to show what the engine made of it
            action = parse_turn(f"<tool_call>{body}</tool_call>").actions[0]  # one block: exactly one action
            if isinstance(action, ToolCall):  # crop(bbox=[10, 20, 200, 300]) reads better than the JSON
                args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in action.arguments.items())
                note = ' <span class="note">(not run: the turn answered)</span>' if turn.answer is not None else ""
                call = _esc(f"{action.name}({args})")
                out.append(f'<div class="call" title="{_esc(body)}">&rarr; {call}{note}</div>')
            else:
                out.append(f'<div class="call bad">&#10007; {_esc(action.kind)}: {_esc(action.message)}</div>')
    if turn.errors:
        errors = "; ".join(f"{e.kind}: {e.message}" for e in turn.errors)
        out.append(f'<div class="bad">parse errors: {_esc(errors)}</div>')
    out.append(f'<details><summary>raw</summary><div class="text">{_esc(text)}</div></details>')
    return "".join(out)


def _message_html(message: Message, cache: dict[Any, str | None]) -> str:
    if message.role == "system":
        summary = f'<summary class="role">system ({len(message.plain_text)} chars)</summary>'
        return f'<details class="msg">{summary}<div class="text">{_esc(message.plain_text)}</div></details>'
    head = _esc(message.role)
    if message.token_ids is not None:
        n, sampled = len(message.token_ids), message.sampled
        head += f" &middot; {n} tokens" + (f" ({sum(sampled)} sampled, {n - sum(sampled)} forced)" if sampled else "")
    if message.role == "assistant":
        return f'<div class="msg assistant"><div class="role">{head}</div>{_assistant_html(message)}</div>'
    body = []
    for part in message.content:
        if part.type == "image":
            body.append(_image_html(part, cache))
        elif part.type == "video":
            stamps = f" ({', '.join(f'{t:.2f}s' for t in part.timestamps)})" if part.timestamps else ""
            body.append(f'<div class="note">video: {_esc(part.path)}{_esc(stamps)}</div>')
        else:
            error = message.role == "tool" and (part.text or "").startswith("Error:")
            body.append(f'<div class="text{" bad" if error else ""}">{_esc(part.text)}</div>')
    return f'<div class="msg {_esc(message.role)}"><div class="role">{head}</div>{"".join(body)}</div>'


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name}: {n}" for name, n in counter.most_common()) or "none"


def _tool_errors(trajectory: Trajectory) -> Counter[str]:
    return Counter({k.split("/", 1)[1]: v for k, v in trajectory.metrics.items() if k.startswith("tool_error/")})


def _trajectory_html(index: int, t: Trajectory, cache: dict[Any, str | None]) -> str:
    facts = [("stop", t.stop_reason), ("answer", "none" if t.answer is None else t.answer)]
    facts += [("reward", f"{t.reward:.4g}")] if t.reward is not None else []
    facts += [
        ("turns", t.metrics.get("turns", sum(msg.role == "assistant" for msg in t.messages))),
        ("tool calls", t.metrics.get("tool_calls", sum(len(msg.tool_calls) for msg in t.messages))),
        ("tool errors", _counts(_tool_errors(t))),
        ("sampled tokens", sum(t.loss_mask) if t.token_ids else t.metrics.get("sampled_tokens", "?")),
    ]
    stop = f'<span class="{"ok" if t.stop_reason == "answered" else "bad"}">{_esc(t.stop_reason)}</span>'
    facts_html = "".join(f"<span><b>{_esc(k)}</b> {_esc(v)}</span>" for k, v in facts)
    metrics = _esc(json.dumps(t.metrics, sort_keys=True))
    messages = "".join(_message_html(msg, cache) for msg in t.messages)
    return (
        f'<section class="traj" data-key="{_esc(f"{t.task_id} {t.stop_reason}".lower())}"><h2>#{index} '
        f'{_esc(t.task_id)} {stop}</h2><div class="facts">{facts_html}</div><details><summary>all metrics</summary>'
        f'<div class="text">{metrics}</div></details>{messages}</section>'
    )


def _summary_html(trajectories: list[Trajectory], shown: int) -> str:
    n, rewards = len(trajectories), [t.reward for t in trajectories if t.reward is not None]
    rows = [("trajectories", f"{n}" + (f" (first {shown} shown)" if shown < n else ""))]
    rows += [("mean reward", f"{sum(rewards) / len(rewards):.4g} over {len(rewards)}")] if rewards else []
    rows += [
        ("answer rate", f"{sum(t.answer is not None for t in trajectories) / n:.1%}" if n else "n/a"),
        ("stop reasons", _counts(Counter(t.stop_reason for t in trajectories))),
        ("tool calls", _counts(Counter(c.name for t in trajectories for m in t.messages for c in m.tool_calls))),
        ("tool errors", _counts(sum((_tool_errors(t) for t in trajectories), Counter()))),
    ]
    cells = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary">{cells}</table>'


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1em auto;max-width:1100px;padding:0 1em;background:#fafafa}
table{border-collapse:collapse}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}#filter{width:24em}
section{background:#fff;border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.5em 1em}h2{font-size:16px}
.facts span{margin-right:1.4em}.msg{border-left:4px solid #bbb;margin:.5em 0;padding:.3em .7em}.bad{color:#b00020}
.user{border-color:#4a7bd0}.assistant{border-color:#3a9d5d}.tool{border-color:#c98a1b}.ok{color:#2a7d46}
.role{font-size:12px;color:#666;text-transform:uppercase}.note{color:#777;font-size:12px}.think{color:#888}
.text,.think{white-space:pre-wrap;overflow-wrap:anywhere}.text{font:13px ui-monospace,monospace}
.call{font-family:ui-monospace,monospace;background:#eef4ff;padding:2px 6px;margin:3px 0}.answer{background:#fff3b0}
.answer{font-weight:bold;padding:2px 6px}figure{display:inline-block;margin:4px;vertical-align:top;text-align:center}
img.thumb{max-width:200px;max-height:200px;border:1px solid #ccc;cursor:zoom-in}img.big{max-width:none;max-height:none}
.missing{width:160px;padding:24px 4px;background:#eee;color:#888;overflow-wrap:anywhere}.think{font-style:italic}"""
_JS = """const box=document.getElementById('filter');
box.addEventListener('input',()=>{const words=box.value.toLowerCase().split(/\\s+/).filter(Boolean);
for(const s of document.querySelectorAll('section.traj'))s.hidden=!words.every(w=>s.dataset.key.includes(w));});
document.addEventListener('click',e=>{if(e.target.classList.contains('thumb'))e.target.classList.toggle('big');});"""


def write_html(
    trajectories: Iterable[Trajectory],
    path: PathLike,
    *,
    title: str = "vagent trajectories",
    max_trajectories: int = 200,
) -> Path:
    """Write one self-contained HTML page (no external CSS, JS or images) showing ``trajectories``, atomically.

    A summary over all trajectories and a filter box (words matched against task id and stop reason), then one
    section for each of the first ``max_trajectories``: stop reason, answer, reward, key metrics, and each message
    as a card. Images, in memory or paths (``read_jsonl``), are embedded downscaled, or a placeholder if unreadable.
    """
    trajectories = list(trajectories)
    shown = trajectories[:max_trajectories]
    cache: dict[Any, str | None] = {}
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{_esc(title)}</title><style>{_CSS}</style>'
        f"</head><body><h1>{_esc(title)}</h1>{_summary_html(trajectories, len(shown))}"
        '<input id="filter" placeholder="filter: task id / stop reason words">'
        + "".join(_trajectory_html(i, t, cache) for i, t in enumerate(shown))
        + f"<script>{_JS}</script></body></html>"
    )
    return _replace_atomically(Path(path), lambda tmp: tmp.write_text(page, encoding="utf-8"))
