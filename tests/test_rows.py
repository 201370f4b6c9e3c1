import json
import os

import pytest
from PIL import Image

from vagent.data import Evidence, Row, RowError, load_rows, write_rows
from vagent.types import Message

TOOLS = ["crop", "zoom_in", "sample_frames"]


def _write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture
def media(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "img" / "a.png")
    (tmp_path / "clip.mp4").write_bytes(b"not decoded: load_rows only checks existence")
    return tmp_path


def _row(**fields):
    base = {"id": "q1", "images": ["img/a.png"], "question": "What colour?", "answer": "red", "answer_type": "exact"}
    return {k: v for k, v in {**base, **fields}.items() if v is not ...}


def test_valid_rows_load_with_resolved_paths_and_extra_keys(media):
    rows_file = _write(
        media / "rows.jsonl",
        _row(source="synthetic", difficulty=3, meta={"seed": 7}, evidence={"boxes": [[1, 2, 30, 40]]}, tools=["crop"]),
        "",  # blank lines are skipped
        _row(id="q2", answer="B", answer_type="choice", choices=["blue", "red"], images=...),
        _row(
            id="q3",
            images=[],
            videos=["clip.mp4"],
            answer=[1.5, 3],
            answer_type="span",
            evidence={"spans": [[1.0, 2.5]]},
        ),
        _row(id="q4", answer=[0, 0, 10, 10.5], answer_type="box"),
        _row(id="q5", answer=3, answer_type="number"),
        _row(
            id="q6",
            answer=["red", "crimson"],
            answer_type="f1",
            messages=[
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": '<tool_call>{"name": "crop", "arguments": {}}</tool_call>'},
                {"role": "tool", "content": [{"type": "image", "path": "img/a.png"}, {"type": "text", "text": "ok"}]},
                {"role": "assistant", "content": "<answer>red</answer>"},
            ],
        ),
    )
    rows = load_rows(rows_file, known_tools=TOOLS)
    assert [r.id for r in rows] == ["q1", "q2", "q3", "q4", "q5", "q6"]
    first = rows[0]
    assert first.images == [str(media / "img" / "a.png")] and os.path.isabs(first.images[0])
    assert first.source == "synthetic" and first.tools == ["crop"]
    assert first.extra == {"difficulty": 3, "meta": {"seed": 7}}
    assert first.evidence == Evidence(boxes=[[1, 2, 30, 40]], spans=[])
    assert rows[1].source == "unknown" and rows[1].images == [] and rows[1].choices == ["blue", "red"]
    assert rows[2].videos == [str(media / "clip.mp4")] and rows[2].answer == [1.5, 3]
    assert rows[3].tools is None and rows[3].evidence is None
    assert rows[5].messages[2].content[0].path == str(media / "img" / "a.png")
    assert rows[5].messages[0].content[0].path == rows[5].images[0]  # a path-less part is the row's prompt image
    assert (
        all(isinstance(m, Message) for m in rows[5].messages)
        and rows[5].messages[3].plain_text == "<answer>red</answer>"
    )


def test_gold_messages_are_message_objects_and_write_back_as_the_canonical_json(tmp_path):
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    turns = [{"role": "assistant", "content": "<think>look</think>", "train": False},
             {"role": "tool", "content": [{"type": "image", "path": str(image)}, {"type": "text", "text": "ok"}]},
             {"role": "assistant", "content": "<answer>red</answer>"}]  # fmt: skip
    row = Row(id="r", question="q?", answer="red", answer_type="exact", images=[str(image)], messages=turns)
    assert [(m.role, m.trained) for m in row.messages] == [("assistant", False), ("tool", True), ("assistant", True)]
    (back,) = load_rows(write_rows([row], tmp_path / "rows.jsonl"))
    assert back.messages == row.messages
    written = json.loads((tmp_path / "rows.jsonl").read_text())["messages"]
    assert written[0] == turns[0] and written[1]["content"][0] == {"type": "image", "path": "a.png"}  # relative
    with pytest.raises(RowError, match=r"row 'bad': field 'messages\[0\].role'"):
        Row(id="bad", question="q?", answer="x", answer_type="exact", messages=[{"role": "robot", "content": "hi"}])


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (_row(question=...), r"rows\.jsonl:2 \(id 'q1'\): field 'question' must be a non-empty string, got None"),
        (_row(question="  "), r":2 \(id 'q1'\): field 'question' must be a non-empty string"),
        (_row(answer_type="exakt"),
         r":2 \(id 'q1'\): field 'answer_type' must be one of \['exact', .*\], got 'exakt' \(did you mean 'exact'\?\)"),
        (_row(answer_type="choice", answer="A"), r":2 \(id 'q1'\): field 'choices' is required when answer_type is"),
        (_row(answer_type="choice", answer="C", choices=["x", "y"]), r"field 'answer' must be one of the letters"),
        (_row(evidence={"boxes": [[1, 2, 3]]}), r":2 \(id 'q1'\): field 'evidence.boxes\[0\]' must be a box"),
        (_row(evidence={"boxes": [[30, 2, 3, 40]]}), r"field 'evidence.boxes\[0\]' must have x1 <= x2"),
        (_row(evidence={"spans": [[1, 2]]}), r"field 'evidence.spans' needs at least one video"),
        (_row(evidence={"box": [[1, 2, 3, 4]]}), r"field 'evidence' has unknown key\(s\) \['box'\]"),
        (_row(images=["img/missing.png"]), r":2 \(id 'q1'\): field 'images\[0\]' names a file that does not exist: "),
        (_row(images=..., image="img/a.png"), r":2 \(id 'q1'\): field 'image' is not a canonical key; did you mean 'images'\?"),
        (_row(tools=["crop", "zoom"]), r":2 \(id 'q1'\): field 'tools\[1\]' names an unknown tool 'zoom'"),
        (_row(answer="3", answer_type="number"), r"field 'answer' must be a JSON number"),
        (_row(answer=[0, 0, 5], answer_type="box"), r"field 'answer' must be a box"),
        (_row(answer=...), r"field 'answer' is required"),
        (_row(id=12), r"rows\.jsonl:2: field 'id' must be a non-empty string, got 12"),
        (_row(messages=[{"role": "robot", "content": "hi"}]), r"field 'messages\[0\]\.role' must be one of"),
        (_row(messages=[{"role": "user", "content": [{"type": "text"}]}]), r"'messages\[0\]\.content\[0\]\.text'"),
        (_row(messages=[{"role": "user", "content": "hi"}]), r"field 'messages' has no assistant turn"),
        (_row(messages=[{"role": "assistant", "content": "hi", "train": False}]),
         r"field 'messages' has no assistant turn to train on"),
        (_row(messages=[{"role": "assistant", "content": "hi", "train": "no"}]),
         r"field 'messages\[0\]\.train' is a true/false flag of assistant turns, got 'no'"),
        (_row(messages=[{"role": "user", "content": "hi", "train": False}, {"role": "assistant", "content": "a"}]),
         r"field 'messages\[0\]\.train' is a true/false flag of assistant turns"),
        ("{\"id\": \"q1\", ", r"rows\.jsonl:2: not valid JSON"),
        ("[1, 2]", r"rows\.jsonl:2: a row must be a JSON object, got list"),
    ],
)  # fmt: skip
def test_errors_name_file_line_id_and_field(media, record, expected):
    rows_file = _write(media / "rows.jsonl", _row(id="q0"), record)  # the bad row is on line 2
    with pytest.raises(RowError, match=expected):
        load_rows(rows_file, known_tools=TOOLS)


def test_file_level_errors(media):
    with pytest.raises(RowError, match=r"rows\.jsonl:3: duplicate id 'q1' \(first on line 1\)"):
        load_rows(_write(media / "rows.jsonl", _row(), _row(id="q2"), _row()))
    with pytest.raises(RowError, match=r"empty\.jsonl: no rows"):
        load_rows(_write(media / "empty.jsonl", "", "  "))
    with pytest.raises(RowError, match="rows file not found"):
        load_rows(media / "nope.jsonl")


def test_check_media_off_and_unknown_tools_unchecked_without_known_tools(media):
    rows = load_rows(_write(media / "rows.jsonl", _row(images=["gone.png"], tools=["teleport"])), check_media=False)
    assert rows[0].images == [str(media / "gone.png")] and rows[0].tools == ["teleport"]


def test_write_then_load_round_trip(media, tmp_path):
    rows_file = _write(
        media / "rows.jsonl",
        _row(evidence={"boxes": [[1, 2, 30, 40]]}, tools=["crop"], note="kept"),
        _row(
            id="q2",
            answer="red",
            answer_type="choice",
            choices=["red", "blue"],
            messages=[
                {"role": "tool", "content": [{"type": "image", "path": "img/a.png"}]},
                {"role": "assistant", "content": "<answer>red</answer>"},
            ],
        ),
    )
    rows = load_rows(rows_file)
    out = write_rows(rows, media / "copy.jsonl")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[0]["images"] == ["img/a.png"]  # under the output's directory: relative
    assert written[1]["messages"][0]["content"][0]["path"] == "img/a.png"
    assert load_rows(out) == rows
    # written elsewhere: media outside the output's directory stay absolute, and the copy still loads
    elsewhere = write_rows(rows, tmp_path / "sub" / "dir" / "rows.jsonl")
    assert json.loads(elsewhere.read_text().splitlines()[0])["images"] == [str(media / "img" / "a.png")]
    assert load_rows(elsewhere) == rows
    assert not [p for p in elsewhere.parent.iterdir() if p.name.endswith(".tmp")]


def test_write_rows_validates_and_leaves_the_old_file_alone(tmp_path):
    target = tmp_path / "rows.jsonl"
    target.write_text("old\n")
    good = Row(id="a", question="q?", answer="x", answer_type="exact")
    with pytest.raises(RowError, match="row 'b': field 'answer_type' must be one of"):
        write_rows([good, Row(id="b", question="q?", answer="x", answer_type="exakt")], target)  # type: ignore[arg-type]
    with pytest.raises(RowError, match="duplicate id 'a'"):
        write_rows([good, good], target)
    assert target.read_text() == "old\n"
    write_rows([good], target)
    assert load_rows(target) == [good]
    assert Row.from_dict(good.to_dict()) == good
