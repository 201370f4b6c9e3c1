"""The canonical row: one JSON object per line of a JSONL file, the single data format every stage reads.

    {"id": "q12", "source": "synthetic", "images": ["img/q12.png"], "videos": [],
     "question": "What digit is on the red tile?", "answer": "7", "answer_type": "exact",
     "evidence": {"boxes": [[410, 220, 438, 248]]}, "tools": ["crop"]}

Paths are relative to the JSONL file (absolute paths are kept as they are). ``load_rows`` checks
every field and stops at the first bad row with an error that names the file, the line, the row's
id and the field, so a pipeline bug is found where it was written rather than deep inside training.

Checked: types and shapes of every known field, answers that fit their ``answer_type`` (a box is
4 numbers with x1 <= x2 and y1 <= y2, a span 2 with 0 <= t0 <= t1, a choice is a letter or one of
``choices``), evidence boxes/spans, tool names (against ``known_tools``), the structure of a gold
``messages`` trajectory (roles, parts) and of a preference pair's ``chosen`` and ``rejected`` trajectories (both
or neither, the same prompt, not the same turns), a judgment row's ``judgment`` against its question and answer
(``vagent.data.judgment``), duplicate ids, singular typos of list keys (``image``), and with ``check_media`` that
every referenced file exists.
Not checked: that media files decode (``vagent.media`` does that when they are used), that boxes lie
inside their image, or what a gold trajectory says.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vagent.data.judgment import Judgment, parse_judgment
from vagent.types import ContentPart, Message

__all__ = ["ANSWER_TYPES", "AnswerType", "Evidence", "Row", "RowError", "load_rows", "write_rows"]

AnswerType = Literal["exact", "choice", "number", "f1", "box", "span"]
ANSWER_TYPES: tuple[str, ...] = ("exact", "choice", "number", "f1", "box", "span")
ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "video")
# Choice answers are letters, so at most one option per letter.
MAX_CHOICES = 26

_KNOWN_KEYS = (
    "id", "source", "images", "videos", "question", "answer", "answer_type",
    "choices", "evidence", "tools", "messages", "chosen", "rejected", "judgment",
)  # fmt: skip
# A judge answers in one turn and a served judge is asked without tools: a judgment row's prompt has no tool schemas.
_NO_JUDGE_TOOLS = "must be [] (or absent) for a judgment row: a judge is trained and asked without tools"
# Keys that are almost certainly a misspelt canonical key. Other unknown keys are kept in ``Row.extra``,
# but these would otherwise be kept silently while the real field stays empty (a row "without" images).
_TYPOS = {
    "image": "images",
    "video": "videos",
    "tool": "tools",
    "choice": "choices",
    "message": "messages",
    "boxes": "evidence",
    "spans": "evidence",
}


class RowError(ValueError):
    """A row that breaks the canonical schema. The message names file:line, the row id and the field."""


class _FieldError(ValueError):
    """A bad field, before it is placed in a file (``load_rows`` adds where)."""

    def __init__(self, name: str | None, message: str) -> None:
        super().__init__(f"field {name!r} {message}" if name else message)


@dataclass
class Evidence:
    """Where the answer can be seen.

    Attributes:
        boxes: ``[x1, y1, x2, y2]`` in pixels of the original (full-resolution) image.
        spans: ``[t0, t1]`` in seconds of the video.
    """

    boxes: list[list[float]] = field(default_factory=list)
    spans: list[list[float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"boxes": self.boxes, "spans": self.spans}


@dataclass
class Row:
    """One canonical row. Build from JSON with ``Row.from_dict`` (which validates); ``to_dict`` is its inverse.

    Attributes:
        id: Unique within its file.
        question: The user's question (non-empty).
        answer: The gold answer, JSON as written: a string (or list of accepted strings) for ``exact``/``f1``,
            a letter or choice text for ``choice``, a number for ``number``, ``[x1, y1, x2, y2]`` for
            ``box``, ``[t0, t1]`` for ``span``.
        answer_type: How the answer is scored.
        images: Image paths (absolute once loaded by ``load_rows``).
        videos: Video paths (absolute once loaded).
        source: Which dataset or pipeline wrote the row.
        choices: The options of a ``choice`` question, shown as "A. ...", "B. ...".
        evidence: Boxes and spans that support the answer (for grounding rewards), or None.
        tools: Names of the tools offered for this row, or None for the run's default. A judgment row offers none:
            its ``tools`` is ``[]`` (None becomes ``[]``; a name is an error), so every stage (SFT, distillation,
            GRPO, eval, the requests to a served judge) shows it the same system prompt whatever the run's default.
        messages: A gold trajectory for SFT as ``Message`` objects. In JSON (and given to the constructor as
            dicts, which it checks and converts): ``[{"role", "content": str | [{"type", "text"?, "path"?}]}]``;
            an assistant turn with ``"train": false`` (``Message.trained``) is shown as context but not trained
            on. Part paths are resolved like ``images``; an image part without a path stands for the row's
            next prompt image (its path is filled in).
        chosen: With ``rejected``, a preference pair for DPO: the better of two trajectories for the row's prompt,
            in the format of ``messages`` (checked and converted the same way).
        rejected: The worse trajectory of the pair. Both start from the same prompt (the row's question and images,
            or the same system/user turns of their own) and differ in their assistant or tool turns.
        judgment: For a judgment row (a judge's training or eval row), what is judged and the label
            (``vagent.data.judgment``); None for every other row.
        extra: Every other key of the JSON object, kept as written.
    """

    id: str
    question: str
    answer: Any
    answer_type: AnswerType
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    source: str = "unknown"
    choices: list[str] | None = None
    evidence: Evidence | None = None
    tools: list[str] | None = None
    messages: list[Message] | None = None
    chosen: list[Message] | None = None
    rejected: list[Message] | None = None
    judgment: Judgment | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.judgment is not None:
            if self.tools:
                raise RowError(f"row {self.id!r}: field 'tools' {_NO_JUDGE_TOOLS}, got {self.tools!r}")
            self.tools = []
        for key in ("messages", "chosen", "rejected"):
            turns = getattr(self, key)
            if turns is not None and any(isinstance(m, dict) for m in turns):
                try:
                    setattr(self, key, _to_messages(_messages(turns, None, key), self.images, key))
                except _FieldError as e:
                    raise RowError(f"row {self.id!r}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the row: canonical keys first (optional ones only when set), then ``extra``."""
        out: dict[str, Any] = {
            "id": self.id,
            "source": self.source,
            "images": list(self.images),
            "videos": list(self.videos),
            "question": self.question,
            "answer": self.answer,
            "answer_type": self.answer_type,
        }
        if self.choices is not None:
            out["choices"] = list(self.choices)
        if self.evidence is not None:
            out["evidence"] = self.evidence.to_dict()
        if self.tools is not None:
            out["tools"] = list(self.tools)
        for key in ("messages", "chosen", "rejected"):
            if getattr(self, key) is not None:
                out[key] = [_message_dict(m) for m in getattr(self, key)]
        if self.judgment is not None:
            out["judgment"] = self.judgment.to_dict()
        return {**out, **self.extra}

    @classmethod
    def from_dict(
        cls, data: Any, *, base_dir: str | os.PathLike[str] | None = None, known_tools: Collection[str] | None = None
    ) -> Row:
        """Validate a JSON object and build the row; relative paths are joined to ``base_dir`` when given.

        Raises:
            RowError: naming the row id and the field (``load_rows`` adds the file and line).
        """
        try:
            return _parse(data, None if base_dir is None else Path(base_dir), known_tools)
        except _FieldError as e:
            raise RowError(f"{_where(None, None, data)}{e}") from None


def _where(path: str | None, line: int | None, data: Any) -> str:
    loc = f"{path}:{line}" if path is not None else ""
    rid = data.get("id") if isinstance(data, dict) else None
    if isinstance(rid, str) and rid:
        loc += f" (id {rid!r})" if loc else f"row {rid!r}"
    return loc + ": " if loc else ""


def _suggest(value: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _box(name: str, value: Any) -> list[float]:
    if not (isinstance(value, list) and len(value) == 4 and all(_is_number(v) for v in value)):
        raise _FieldError(name, f"must be a box [x1, y1, x2, y2] of 4 numbers, got {value!r}")
    x1, y1, x2, y2 = value
    if x1 > x2 or y1 > y2:
        raise _FieldError(name, f"must have x1 <= x2 and y1 <= y2, got {value!r}")
    return value


def _span(name: str, value: Any) -> list[float]:
    if not (isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value)):
        raise _FieldError(name, f"must be a span [t0, t1] of 2 numbers (seconds), got {value!r}")
    if not 0 <= value[0] <= value[1]:
        raise _FieldError(name, f"must have 0 <= t0 <= t1, got {value!r}")
    return value


def _str_list(name: str, value: Any, *, allow_empty: bool = True) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _FieldError(name, f"must be a list of strings, got {type(value).__name__} {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise _FieldError(f"{name}[{i}]", f"must be a non-empty string, got {item!r}")
    if not value and not allow_empty:
        raise _FieldError(name, "must not be empty")
    return value


def _resolve(path: str, base: Path | None) -> str:
    if base is None or os.path.isabs(path):
        return path
    return os.path.normpath(base / path)


def _answer(answer: Any, answer_type: str, choices: list[str] | None) -> None:
    if answer_type in ("exact", "f1"):
        ok = (isinstance(answer, str) and answer.strip()) or (
            isinstance(answer, list) and answer and all(isinstance(a, str) and a.strip() for a in answer)
        )
        if not ok:
            raise _FieldError(
                "answer", f"must be a non-empty string or list of strings for {answer_type!r}, got {answer!r}"
            )
    elif answer_type == "number":
        if not _is_number(answer):
            raise _FieldError("answer", f"must be a JSON number for 'number' (e.g. 3 or 2.5, not '3'), got {answer!r}")
    elif answer_type == "box":
        _box("answer", answer)
    elif answer_type == "span":
        _span("answer", answer)
    elif answer_type == "choice":
        assert choices is not None
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        if not (isinstance(answer, str) and (answer in letters or answer in choices)):
            raise _FieldError("answer", f"must be one of the letters {letters} or one of 'choices', got {answer!r}")


def _evidence(value: Any, n_images: int, n_videos: int) -> Evidence | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _FieldError("evidence", f'must be an object {{"boxes": [...], "spans": [...]}}, got {value!r}')
    unknown = sorted(set(value) - {"boxes", "spans"})
    if unknown:
        raise _FieldError("evidence", f"has unknown key(s) {unknown}; expected 'boxes' and/or 'spans'")
    evidence = Evidence()
    for key, check, make in (("boxes", _box, evidence.boxes), ("spans", _span, evidence.spans)):
        items = value.get(key) or []
        if not isinstance(items, list):
            raise _FieldError(f"evidence.{key}", f"must be a list, got {items!r}")
        make.extend(check(f"evidence.{key}[{i}]", item) for i, item in enumerate(items))
    if evidence.boxes and not n_images:
        raise _FieldError("evidence.boxes", "needs at least one image in 'images'")
    if evidence.spans and not n_videos:
        raise _FieldError("evidence.spans", "needs at least one video in 'videos'")
    return evidence


def _messages(value: Any, base: Path | None, key: str = "messages") -> list[dict[str, Any]] | None:
    """Checked JSON turns of a gold trajectory (``messages``, ``chosen`` or ``rejected``: ``key`` names the field)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _FieldError(key, f"must be a non-empty list of {{role, content}} objects, got {value!r}")
    out = []
    for i, message in enumerate(value):
        name = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise _FieldError(name, f"must be an object {{role, content}}, got {message!r}")
        if message.get("role") not in ROLES:
            raise _FieldError(f"{name}.role", f"must be one of {list(ROLES)}, got {message.get('role')!r}")
        if "train" in message and (message["role"] != "assistant" or not isinstance(message["train"], bool)):
            raise _FieldError(f"{name}.train", f"is a true/false flag of assistant turns, got {message['train']!r}")
        content = message.get("content")
        if isinstance(content, str):
            out.append(dict(message))
            continue
        if not isinstance(content, list):
            raise _FieldError(f"{name}.content", f"must be a string or a list of parts, got {content!r}")
        parts = []
        for j, part in enumerate(content):
            where = f"{name}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
                raise _FieldError(where, f"must be a part {{type: {'|'.join(PART_TYPES)}, ...}}, got {part!r}")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _FieldError(f"{where}.text", f"must be a string, got {part.get('text')!r}")
            path = part.get("path")
            if path is not None and (not isinstance(path, str) or not path):
                raise _FieldError(f"{where}.path", f"must be a non-empty string, got {path!r}")
            if part["type"] == "video" and path is None:
                raise _FieldError(f"{where}.path", "is required for a video part")
            parts.append({**part, "path": _resolve(path, base)} if path else dict(part))
        out.append({**message, "content": parts})
    if not any(m["role"] == "assistant" and m.get("train", True) for m in out):
        raise _FieldError(key, "has no assistant turn to train on")
    return out


def _pair(chosen: list[dict[str, Any]] | None, rejected: list[dict[str, Any]] | None) -> None:
    """A preference pair is both trajectories, for one prompt, and two different ones."""
    if (chosen is None) != (rejected is None):
        given, missing = ("chosen", "rejected") if rejected is None else ("rejected", "chosen")
        raise _FieldError(missing, f"is required with {given!r} (a preference pair is both trajectories)")
    if chosen is None or rejected is None:
        return

    def prompt(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return turns[: next(i for i, t in enumerate(turns) if t["role"] == "assistant")]

    if prompt(chosen) != prompt(rejected):
        raise _FieldError("rejected", "must start from the prompt 'chosen' starts from (the same system/user turns)")
    if chosen == rejected:
        raise _FieldError("rejected", "is the same trajectory as 'chosen'; a pair needs two different ones")


def _to_messages(turns: list[dict[str, Any]] | None, images: list[str], key: str = "messages") -> list[Message] | None:
    """Checked JSON turns (``_messages``) as ``Message`` objects; path-less image parts take the next prompt image."""
    if turns is None:
        return None
    prompt_images = iter(images)
    out = []
    for i, turn in enumerate(turns):
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for j, part in enumerate(content):
            path = part.get("path")
            if part["type"] == "image" and path is None:
                path = next(prompt_images, None)
                if path is None:
                    raise _FieldError(f"{key}[{i}].content[{j}]", "uses more images than the row has")
            parts.append(ContentPart(part["type"], text=part.get("text"), path=path))
        out.append(Message(turn["role"], parts, trained=turn.get("train", True)))
    return out


def _message_dict(message: Message, relative_to: Path | None = None) -> dict[str, Any]:
    """A gold turn as its JSON object: one text part as a string, paths relative to ``relative_to`` when given."""
    out: dict[str, Any] = {"role": message.role}
    if len(message.content) == 1 and message.content[0].type == "text":
        out["content"] = message.content[0].text
    else:
        out["content"] = [
            {"type": p.type, **({"text": p.text} if p.text is not None else {}),
             **({"path": _relative(p.path, relative_to) if relative_to else p.path} if p.path else {})}
            for p in message.content
        ]  # fmt: skip
    if not message.trained:
        out["train"] = False
    return out


def _parse(data: Any, base: Path | None, known_tools: Collection[str] | None) -> Row:
    if not isinstance(data, dict):
        raise _FieldError(None, f"a row must be a JSON object, got {type(data).__name__}")
    for typo, key in _TYPOS.items():
        if typo in data and key not in data:
            raise _FieldError(typo, f"is not a canonical key; did you mean {key!r}?")
    rid = data.get("id")
    if not isinstance(rid, str) or not rid.strip():
        raise _FieldError("id", f"must be a non-empty string, got {rid!r}")
    question = data.get("question")
    if not isinstance(question, str) or not question.strip():
        raise _FieldError("question", f"must be a non-empty string, got {question!r}")
    source = data.get("source", "unknown")
    if not isinstance(source, str):
        raise _FieldError("source", f"must be a string, got {source!r}")
    answer_type = data.get("answer_type")
    if answer_type not in ANSWER_TYPES:
        hint = _suggest(answer_type, ANSWER_TYPES) if isinstance(answer_type, str) else ""
        raise _FieldError("answer_type", f"must be one of {list(ANSWER_TYPES)}, got {answer_type!r}{hint}")
    choices = data.get("choices")
    if choices is not None:
        choices = _str_list("choices", choices, allow_empty=False)
        if len(choices) > MAX_CHOICES:
            raise _FieldError("choices", f"has {len(choices)} options; at most {MAX_CHOICES} (one per letter)")
    elif answer_type == "choice":
        raise _FieldError("choices", "is required when answer_type is 'choice'")
    if "answer" not in data:
        raise _FieldError("answer", "is required")
    _answer(data["answer"], answer_type, choices)
    images = [_resolve(p, base) for p in _str_list("images", data.get("images"))]
    videos = [_resolve(p, base) for p in _str_list("videos", data.get("videos"))]
    tools = data.get("tools")
    if tools is not None:
        tools = _str_list("tools", tools)
        for i, name in enumerate(tools):
            if known_tools is not None and name not in known_tools:
                hint = _suggest(name, known_tools)
                raise _FieldError(f"tools[{i}]", f"names an unknown tool {name!r}{hint}; known: {sorted(known_tools)}")
    chosen, rejected = _messages(data.get("chosen"), base, "chosen"), _messages(data.get("rejected"), base, "rejected")
    _pair(chosen, rejected)
    judgment = None
    if data.get("judgment") is not None:
        try:
            judgment = parse_judgment(data["judgment"], question=question, answer=data["answer"],
                                      answer_type=answer_type, n_images=len(images))  # fmt: skip
        except ValueError as e:
            raise _FieldError(None, str(e)) from None  # the message names the sub-field
        if tools:
            raise _FieldError("tools", f"{_NO_JUDGE_TOOLS}, got {tools!r}")
    return Row(
        id=rid,
        question=question,
        answer=data["answer"],
        answer_type=answer_type,
        images=images,
        videos=videos,
        source=source,
        choices=choices,
        evidence=_evidence(data.get("evidence"), len(images), len(videos)),
        tools=tools,
        messages=_to_messages(_messages(data.get("messages"), base), images),
        chosen=_to_messages(chosen, images, "chosen"),
        rejected=_to_messages(rejected, images, "rejected"),
        judgment=judgment,
        extra={k: v for k, v in data.items() if k not in _KNOWN_KEYS},
    )


def _media_paths(row: Row) -> Iterable[tuple[str, str]]:
    """(field, path) of every file the row refers to."""
    yield from ((f"images[{i}]", p) for i, p in enumerate(row.images))
    yield from ((f"videos[{i}]", p) for i, p in enumerate(row.videos))
    for key in ("messages", "chosen", "rejected"):
        for i, message in enumerate(getattr(row, key) or []):
            for j, part in enumerate(message.content):
                if part.path:
                    yield f"{key}[{i}].content[{j}].path", part.path


def load_rows(
    path: str | os.PathLike[str], *, check_media: bool = True, known_tools: Collection[str] | None = None
) -> list[Row]:
    """Read and validate a canonical JSONL file. Blank lines are skipped.

    Args:
        path: The JSONL file.
        check_media: Check that every image, video and gold-message path exists (not that it decodes).
        known_tools: Tool names a row's ``tools`` may use (``vagent.toolbox.TOOLS``); None skips the check.

    Returns:
        The rows in file order, with media paths made absolute against the file's directory.

    Raises:
        RowError: the first problem, e.g. ``rows.jsonl:7 (id 'q12'): field 'answer_type' must be one of
            [...], got 'exakt'``; also a missing or empty file and duplicate ids.
    """
    name = str(path)
    file = Path(path)
    if not file.is_file():
        raise RowError(f"rows file not found: {name}")
    base = file.resolve().parent
    rows: list[Row] = []
    first_line: dict[str, int] = {}
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise RowError(f"{name}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
            try:
                row = _parse(data, base, known_tools)
                if check_media:
                    for key, media in _media_paths(row):
                        if not os.path.isfile(media):
                            raise _FieldError(key, f"names a file that does not exist: {media}")
            except _FieldError as e:
                raise RowError(f"{_where(name, number, data)}{e}") from None
            if row.id in first_line:
                raise RowError(f"{name}:{number}: duplicate id {row.id!r} (first on line {first_line[row.id]})")
            first_line[row.id] = number
            rows.append(row)
    if not rows:
        raise RowError(f"{name}: no rows (the file is empty)")
    return rows


def _relative(path: str, out_dir: Path) -> str:
    """``path`` relative to ``out_dir`` when it lies under it, else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return absolute.relative_to(out_dir).as_posix()
    except ValueError:
        return str(absolute)


def write_rows(rows: Iterable[Row], path: str | os.PathLike[str]) -> Path:
    """Validate and write rows as canonical JSONL, atomically (a reader never sees half a file).

    Media paths under the output file's directory are written relative to it, others absolute, so
    the file and its media can be moved together.

    Raises:
        RowError: a row that breaks the schema, or a duplicate id (nothing is written).
    """
    out = Path(path)
    out_dir = Path(os.path.abspath(out.parent))
    lines, seen = [], set()
    for row in rows:
        data = row.to_dict()
        Row.from_dict(data)  # a pipeline bug fails here, at write time, not when training reads the file
        if row.id in seen:
            raise RowError(f"duplicate id {row.id!r}")
        seen.add(row.id)
        data["images"] = [_relative(p, out_dir) for p in row.images]
        data["videos"] = [_relative(p, out_dir) for p in row.videos]
        for key in ("messages", "chosen", "rejected"):
            if getattr(row, key) is not None:
                data[key] = [_message_dict(m, out_dir) for m in getattr(row, key)]
        lines.append(json.dumps(data, ensure_ascii=False) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
