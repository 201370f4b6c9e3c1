"""The tool-choice rows (``data_pipelines.synthetic.tools``) hold what makes them a fair test of tool choice: every
kind is built, every gold tool turn is what the real tool returns, a search row's answer ends its first hit among
distractors, a code row's answer is what the sandbox printed, no training answer scores on a test search row, and
the rows survive the file and the SFT encoder. Answers are scored with MAT's token F1 / EM, the metric of
Visual-ARFT's evaluation code (``vagent.eval.benchmarks.mat_search``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from data_pipelines.synthetic.tools import (
    ENTITIES,
    KINDS,
    PROPERTIES,
    SPLITS,
    TOOLS,
    VALUES,
    main,
    query_rows,
    split_of,
    tool_rows,
    world,
)
from vagent.chat import observation_content, parse_turn
from vagent.data import load_rows, write_rows
from vagent.eval.metrics import f1_em_metrics
from vagent.media import smart_resize
from vagent.toolbox import TOOLS as TOOLBOX
from vagent.toolbox import ToolContext, call_tool
from vagent.toolbox.sandbox import Sandbox
from vagent.toolbox.search import BM25Backend

# the code rows' gold calls run in bubblewrap, as tests/test_tool_training.py's do
pytestmark = pytest.mark.skipif(not Sandbox().available(), reason="bubblewrap (bwrap) is missing or does not work here")
FRAME = dict(min_pixels=3136, max_pixels=200704, factor=28, convention="absolute")  # tool_rows' default frame


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(train rows, test rows, corpus path, val rows): one world, three row seeds, test and val search-heavy."""
    out = tmp_path_factory.mktemp("tools")
    train = tool_rows(out, 25, seed=0, split="train")
    test = tool_rows(out, 12, seed=1, split="test", shares=(0.5, 0.25, 0.0, 0.25))
    val = tool_rows(out, 8, seed=2, split="val", shares=(1.0, 0.0, 0.0, 0.0))
    return train, test, out / "corpus-0.jsonl", val


def _tool_turns(row):
    """(the parsed gold call, the tool turn after it) of each call in the row's gold trajectory."""
    for call, result in zip(row.messages, row.messages[1:], strict=False):
        if call.role == "assistant" and "<tool_call>" in call.plain_text:
            [tool_call] = parse_turn(call.plain_text).tool_calls
            assert result.role == "tool"
            yield tool_call, result


def test_every_kind_is_built_offering_every_tool_and_scored_by_mat_f1(built):
    train, test, _, _ = built
    assert Counter(r.extra["kind"] for r in train) == {"search": 10, "code": 5, "crop": 5, "direct": 5}
    assert set(KINDS) == {r.extra["kind"] for r in train}
    for row in train + test:
        assert row.tools == TOOLS and row.source == f"synthetic/tools-{row.extra['kind']}"
        assert row.answer_type == "f1" and isinstance(row.answer, list) and all(isinstance(a, str) for a in row.answer)
        calls = [call.name for call, _ in _tool_turns(row)]
        assert calls == ([] if row.extra["kind"] == "direct" else [row.extra["kind"]])
        final = parse_turn(row.messages[-1].plain_text).answer  # the gold answer scores 1 on MAT's F1 and EM
        assert f1_em_metrics(final, row.answer) == {"f1": 1.0, "em": 1.0}, row.id


def test_every_gold_tool_turn_is_what_the_toolbox_returns(built):
    """Each gold call, run again through ``call_tool`` with the engine's context (the row's image, the corpus, the
    policy's frame), gives the tool turn the row holds: the same text, the same pixels."""
    train, test, corpus, _ = built
    search = BM25Backend(corpus)
    for row in train + test:
        image = Image.open(row.images[0]).convert("RGB")
        height, width = smart_resize(image.height, image.width, min_pixels=FRAME["min_pixels"],
                                     max_pixels=FRAME["max_pixels"], factor=FRAME["factor"])  # fmt: skip
        context = ToolContext(images=[image], model_sizes=[(width, height)], convention=FRAME["convention"],
                              min_pixels=FRAME["min_pixels"], max_pixels=FRAME["max_pixels"],
                              image_factor=FRAME["factor"], search=search)  # fmt: skip
        for call, turn in _tool_turns(row):
            observation = call_tool(call, context, offered=TOOLS)
            assert observation.error is None, (row.id, observation.text)
            observation = dataclasses.replace(observation, first_image=1)  # labelled after the prompt's image
            expected, images = observation_content(observation), iter(observation.images)
            assert [p["type"] for p in expected] == [p.type for p in turn.content]
            for want, got in zip(expected, turn.content, strict=True):
                if got.type == "text":
                    assert got.text == want["text"], row.id
                else:
                    assert np.array_equal(np.asarray(Image.open(got.path).convert("RGB")), np.asarray(next(images)))


def test_the_first_search_hit_holds_the_answer_and_the_others_are_distractors(built):
    train, test, corpus, _ = built
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    facts = world(0)
    assert len(records) == len(facts) > len(ENTITIES) * len(PROPERTIES)  # decoy entities beside the real ones
    assert set(facts.values()) == set(VALUES)
    search = BM25Backend(corpus)
    for entity in ENTITIES:  # every pair a row may ask, not only those drawn here
        for prop in PROPERTIES:
            hits = search.search(f"{entity} {prop}", 3)
            assert hits[0].title == f"{entity.capitalize()}: {prop}"
            assert hits[0].snippet == f"The {prop} of the {entity} is {facts[entity, prop]}."
            assert len(hits) == 3 and all(hit.title != hits[0].title for hit in hits[1:])  # other facts
    searched = [row for row in train + test if row.extra["kind"] == "search"]
    assert searched
    for row in searched:
        [(call, turn)] = _tool_turns(row)
        assert call.arguments == {"query": f"{row.extra['entity']} {row.extra['property']}", "k": 1}
        assert turn.content[0].text.count("\n") <= 2 and turn.content[0].text.endswith(f" is {row.answer[0]}.")
        assert row.question == f"What is the {row.extra['property']} of the object in the image?"


def test_a_code_rows_answer_is_the_sandboxs_output_and_the_exact_result(built):
    train, test, _, _ = built
    coded = [row for row in train + test if row.extra["kind"] == "code"]
    assert {"*" in row.question for row in coded} == {True, False}  # products and sums
    for row in coded:
        [(call, turn)] = _tool_turns(row)
        assert turn.content[0].text == f"stdout:\n{row.answer[0]}"
        numbers = [int(n) for n in re.findall(r"\d+", row.question)]
        assert len(numbers) == (2 if "*" in row.question else 3) and all(12 <= n <= 99 for n in numbers)
        assert int(row.answer[0]) == (math.prod(numbers) if "*" in row.question else sum(numbers))
        # the program prints the question's expression, copied token for token
        expression = row.question.removeprefix("What is ").removesuffix("?")
        assert call.arguments["code"] == f"print({expression})"
        # the last think quotes the tool's turn, so the number follows the same tokens there as in the tool's turn
        assert f"<think>The program printed:\n{turn.content[0].text}</think>" in row.messages[-1].plain_text


def test_without_the_search_a_test_search_row_is_a_guess_among_eight(built):
    """The baseline without tools can only guess a test search row's value: each split's facts spread evenly over
    the 8 values, so one word scores 1/8 of F1 on the test facts and the best answer of any words, all 8 listed, 2/9
    (precision 1/8, recall 1); and each split (val picks a run's
    checkpoint) asks its own pairs."""
    train, test, _, val = built
    for split, rows in (("train", train), ("test", test), ("val", val)):
        asked = [r for r in rows if r.extra["kind"] == "search"]
        assert asked and all(split_of(r.extra["entity"], r.extra["property"]) == split for r in asked), split
        assert all(r.answer[0] in VALUES for r in asked)
    facts = world(0)
    for split in SPLITS:
        values = Counter(v for (e, p), v in facts.items() if e in ENTITIES and split_of(e, p) == split)
        assert set(values) == set(VALUES) and len(set(values.values())) == 1, split  # as many of each
    tested = [facts[e, p] for e in ENTITIES for p in PROPERTIES if split_of(e, p) == "test"]

    def f1(guess):
        return sum(f1_em_metrics(guess, [v])["f1"] for v in tested) / len(tested)

    assert max(f1(word) for word in VALUES) == 1 / len(VALUES)
    listed = [" ".join(c) for k in range(1, len(VALUES) + 1) for c in itertools.combinations(VALUES, k)]
    assert max(map(f1, listed)) == pytest.approx(2 / 9) == f1(" ".join(VALUES))
    # each entity keeps one pair for test and one for val, every property searched in training: no held-out value
    for split in ("test", "val"):
        assert sum(split_of(e, p) == split for e in ENTITIES for p in PROPERTIES) == len(ENTITIES)
        assert {p for e in ENTITIES for p in PROPERTIES if split_of(e, p) == split} == set(PROPERTIES)
    assert {p for e in ENTITIES for p in PROPERTIES if split_of(e, p) == "train"} == set(PROPERTIES)
    with pytest.raises(ValueError, match="split must be one of"):
        tool_rows("unused", 1, split="dev")


def test_query_rows_teach_every_pairs_call_and_show_no_value(tmp_path):
    """``query_rows``: one row per (entity, property) pair, held-out pairs included, each a search row's first turn
    alone (the gold call a search row makes) and nothing of the corpus: no hit and no value anywhere in the row."""
    rows = query_rows(tmp_path, seed=0)
    pairs = [(r.extra["entity"], r.extra["property"]) for r in rows]
    assert sorted(pairs) == sorted((e, p) for e in ENTITIES for p in PROPERTIES)
    assert {split_of(*pair) for pair in pairs} == set(SPLITS)
    for row, (entity, prop) in zip(rows, pairs, strict=True):
        [turn] = row.messages
        [call] = parse_turn(turn.plain_text).tool_calls
        assert turn.role == "assistant" and row.tools == TOOLS and Image.open(row.images[0]).size == (224, 224)
        assert call.name == "search" and call.arguments == {"query": f"{entity} {prop}", "k": 1}
        assert row.question == f"What is the {prop} of the object in the image?"  # as a search row asks
        assert not set(re.findall(r"[a-z]+", json.dumps(row.to_dict()))) & set(VALUES)


def test_rows_round_trip_through_the_file_and_the_same_seeds_build_the_same_rows(built, tmp_path):
    train, _, _, _ = built
    path = write_rows(train, tmp_path / "rows.jsonl")
    assert [r.to_dict() for r in load_rows(path, known_tools=TOOLBOX)] == [r.to_dict() for r in train]
    again = tool_rows(tmp_path / "again", 25, seed=0, split="train")  # elsewhere: only the media paths differ
    assert [(r.id, r.question, r.answer, r.extra) for r in again] == [
        (r.id, r.question, r.answer, r.extra) for r in train
    ]
    assert (tmp_path / "again" / "corpus-0.jsonl").read_text() == built[2].read_text()
    assert np.array_equal(np.asarray(Image.open(again[0].images[0])), np.asarray(Image.open(train[0].images[0])))


def test_the_sft_encoder_takes_a_batch_of_every_kind(built, tiny_qwen25, tmp_path):
    """A micro-batch of one row of each kind and a query row (a conversation that ends on its call) encodes, and
    its loss mask trains the calls and answers, never the hits or the program's output (but where the gold think
    quotes it)."""
    from vagent.model import load_policy
    from vagent.training.data import SFTDataset

    train, _, _, _ = built
    rows = [next(r for r in train if r.extra["kind"] == kind) for kind in KINDS]
    rows.append(next(q for q in query_rows(tmp_path) if all(q.question != r.question for r in rows)))
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    min_pixels, max_pixels = policy.pixel_budget
    data = SFTDataset(rows, policy.processor, default_tools=[], max_length=10**5, micro_batch_size=4, seed=0,
                      group_by_length=False, group_batches=1, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=policy.image_factor)  # fmt: skip
    assert data.skipped == [] and len(data) == 2
    batch = {key: [x for i in range(len(data)) for x in data[i][key]] for key in ("input_ids", "loss_mask")}
    texts = [policy.tokenizer.decode(ids) for ids in batch["input_ids"]]
    trained = [policy.tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["input_ids"], batch["loss_mask"],
                                                                                strict=True)]  # fmt: skip
    for row in rows:
        [k] = [k for k, text in enumerate(texts) if row.question in text]
        assert all(f'"name": "{tool}"' in texts[k] for tool in TOOLS)  # the system prompt offers all three
        if row.source == "synthetic/tools-query":  # its call is trained, and nothing follows it
            assert f'"query": "{row.answer}"' in trained[k] and trained[k].rstrip().endswith("<|im_end|>")
            continue
        assert f"{row.answer[0]}</answer>" in trained[k]
        for _, turn in _tool_turns(row):
            observed = next(p.text for p in turn.content if p.type == "text")
            quoted = sum(observed in m.plain_text for m in row.messages if m.role == "assistant")  # a code row's think
            assert observed in texts[k] and trained[k].count(observed) == quoted, row.id  # context, never a target


def test_the_cli_writes_train_and_test_rows_and_the_corpus(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--rows", "4", "--test-rows", "4", "--shares", "1", "0", "0", "1"]) == 0
    assert "corpus-0.jsonl" in capsys.readouterr().out
    train, test = load_rows(tmp_path / "rows.jsonl"), load_rows(tmp_path / "test.jsonl")
    assert len(train) == len(test) == 4 and (tmp_path / "corpus-0.jsonl").is_file()
    assert all(r.extra["split"] == "test" for r in test)
