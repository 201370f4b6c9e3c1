"""The video proof's data: glimpse clips (``data_pipelines.synthetic.video.glimpse_rows``) split into train, test and
val, the warm-up phases' rows of other clips, and the two SFT mixes (the crop_clip trajectories, and the same rows
answered from the first view alone)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from quickstart.data import built, mark_built
from vagent.data import Row, write_rows

# Warm-up phases of the video proof, each a plain SFT run on other clips' rows: perception (the color, read from the
# gold clip's frames shown alone), grounding (the time of the marked frame, read from the first view), and both (the
# two kinds of rows together: grounding learned while perception is kept; docs/decisions/video-glimpse-task.md).
VIDEO_WARMUP = ("perception", "grounding", "both")
# The skills a phase's checkpoint is checked on (the val clips' rows of each).
CHECKS = {"perception": ("perception",), "grounding": ("grounding",), "both": ("perception", "grounding")}


def build_video_data(cfg, out: Path) -> dict[str, Path]:
    """train (gold crop_clip-then-answer rows, GRPO's prompts), test, val, each warm-up phase's rows (other clips),
    each warm-up phase's check rows (the val clips'), and the two SFT mixes: ``sft_mix`` (train + its rows' perception
    and grounding rows) and ``sft_mix_notool`` (the train rows answered from the first view without a tool, + the same
    perception and grounding rows): as many rows, so both SFT runs take as many steps."""
    from data_pipelines.synthetic.video import glimpse_rows

    names = ("train", "test", "val", "sft_mix", "sft_mix_notool",
             *(f"warmup_{p}" for p in VIDEO_WARMUP), *(f"check_{p}" for p in ("perception", "grounding")))  # fmt: skip
    paths = {name: out / f"{name}.jsonl" for name in names}
    recipe = {"seed": cfg.seed, "rows": [cfg.train_rows, cfg.test_rows, cfg.val_rows, cfg.warmup_rows],
              "clip": dataclasses.asdict(cfg.clip)}  # fmt: skip
    if built(out, paths, recipe):
        return paths
    clip = cfg.clip
    knobs = dict(duration=clip.duration, frames=clip.frames, fps=clip.fps, flash_frames=clip.flash_frames,
                 size=tuple(clip.size))  # fmt: skip
    train = glimpse_rows(out, cfg.train_rows, seed=cfg.seed, **knobs)
    test = glimpse_rows(out, cfg.test_rows, seed=cfg.seed + 10_000, **knobs)
    val = glimpse_rows(out, max(cfg.val_rows, 1), seed=cfg.seed + 30_000, **knobs)
    pool = glimpse_rows(out, cfg.warmup_rows, seed=cfg.seed + 20_000, **knobs) if cfg.warmup_rows else []
    warmup, checks, support = (warmup_rows(rows) for rows in (pool, val, train))
    notool = [answered_directly(row) for row in train]
    write_rows(train, paths["train"])
    write_rows(test, paths["test"])
    write_rows(val[: cfg.val_rows], paths["val"])
    for phase in ("perception", "grounding"):
        write_rows(warmup[phase], paths[f"warmup_{phase}"])
        write_rows(checks[phase], paths[f"check_{phase}"])
    write_rows(warmup["perception"] + warmup["grounding"], paths["warmup_both"])
    shared = support["perception"] + support["grounding"]
    write_rows(train + shared, paths["sft_mix"])
    write_rows(notool + shared, paths["sft_mix_notool"])
    print(f"{len(train)} train clips + {len(shared)} perception and grounding rows of theirs for both SFT mixes, "
          f"{len(pool)} warm-up clips, {len(test)} test clips, {cfg.val_rows} val clips for GRPO, "
          f"{clip.size[0]}x{clip.size[1]} at {clip.fps:g} frames/s, in {out}")  # fmt: skip
    mark_built(out, recipe)
    return paths


def answered_directly(row: Row) -> Row:
    """The row answered from its first view, without a tool: the no-tool baseline's gold (the first view never
    shows the color, so this learns the answers' prior and nothing more)."""
    answer = f"<think>The square is {row.answer}.</think>\n<answer>{row.answer}</answer>"
    return dataclasses.replace(row, tools=[], messages=[{"role": "assistant", "content": answer}])


def warmup_rows(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows that train one skill each, as the crop proof's warm-up does: perception (read the color from the gold
    clip's frames shown alone as images, the skill the clip is for) and grounding (the time of the marked frame, as
    the first view prints it, the skill of choosing where to cut; the first view is the row's video under the
    rollout's frame budget)."""
    perception, grounding = [], []
    for row in rows:
        frames = [part.path for part in row.messages[1].content if part.type == "image"]
        perception.append(Row(id=f"{row.id}-see", question=row.question, answer=row.answer, answer_type="exact",
                              images=frames, tools=[], source="synthetic/video-glimpse-perception",
                              messages=[{"role": "assistant", "content": f"<answer>{row.answer}</answer>"}]))  # fmt: skip
        when = f"t={row.extra['marked']:.2f}s"
        grounding.append(Row(id=f"{row.id}-when", question="A dark square appears once. At which of the times shown "
                             "is it on screen?", answer=when, answer_type="exact", videos=list(row.videos), tools=[],
                             source="synthetic/video-glimpse-grounding",
                             messages=[{"role": "assistant", "content": f"<answer>{when}</answer>"}]))  # fmt: skip
    return {"perception": perception, "grounding": grounding}
