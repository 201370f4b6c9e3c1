"""The proofs' configurations: what every proof shares (``ProofConfig``: splits, warm-up, SFT, GRPO, evaluation), the
crop task's (``QuickstartConfig``, ``make run``), the video task's (``VideoConfig``) and the search-and-code task's
(``ToolsConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vagent.config import (
    ConfigError,
    GRPOAlgoConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TinyModelConfig,
    ToolboxConfig,
    option,
)

__all__ = ["ClipConfig", "ProofConfig", "QuickstartConfig", "ToolsConfig", "VideoConfig", "config_class"]


@dataclass
class ProofConfig:
    """What every proof shares: the policy, the splits, the warm-up, SFT, GRPO and the evaluations' knobs."""

    # the warm-up phases a proof knows (warmup_phases)
    PHASES = ("grounding", "perception", "reading")

    out_dir: str = option("runs/quickstart", "Everything the quickstart writes: data, checkpoints, evals, report.md.")
    seed: int = option(0, "Seed of the data, the training order and sampling.")
    model: ModelConfig = option(
        ModelConfig(min_pixels=3136, max_pixels=50176),
        "Policy to start from: path null builds the random tiny one (``tiny``) under out_dir.",
    )
    tiny: TinyModelConfig = option(
        TinyModelConfig(size="small", rope_theta=10.0), "The random tiny checkpoint built when model.path is null."
    )
    train_rows: int = option(448, "Synthetic zoom rows with gold trajectories for SFT (and prompts for GRPO).")
    test_rows: int = option(192, "Held-out rows the policies are evaluated on.")
    val_rows: int = option(
        64,
        "Held-out rows (other images than train and test) GRPO answers every grpo_val_every steps (see "
        "grpo_val_samples), its start included; the best step is the GRPO policy (0: no validation, the last step).",
    )
    grpo_val_every: int = option(4, "GRPO steps between validations on the val rows.")
    grpo_val_samples: int = option(
        1,
        "Samples of each val row at GRPO's temperature (rollout.temperature) in its validation, so it keeps the step "
        "whose samples score best: the policy GRPO optimizes (0: greedy validation).",
    )
    grpo_keep_alpha: float = option(
        1.0,
        "A later GRPO step replaces the kept one only when a one-sided paired sign-flip test of their per-row val "
        "accuracies gives p <= this (val.keep_alpha; 1: any gain).",
    )
    sampled_test_samples: int = option(
        1,
        "Samples of each test row at GRPO's temperature for the SFT and GRPO policies: what the GRPO target compares "
        "(0: greedy evaluations only, and the target compares greedy accuracies).",
    )
    warmup_rows: int = option(3000, "Images (apart from train and test) whose rows warm up SFT (see warmup_phases).")
    warmup_epochs: float | list[float] = option(
        [2.0, 2.0],
        "Passes of each warm-up phase over its rows: one number for every phase, or a list in warmup_phases' "
        "order (0 skips a phase).",
    )
    warmup_phases: list[str] = option(
        ["perception", "grounding"],
        "Warm-up SFT runs in order, each continuing from the last; both SFT runs start from the end. grounding: "
        "give the tile's box; perception: read a gold crop shown alone; reading: read it in a gold trajectory "
        "(the crop call shown, not trained).",
    )
    sft_epochs: float = option(2.0, "SFT passes over the training mix (the no-tool baseline gets the same steps).")
    sft_lr: float = option(5e-4, "SFT peak learning rate.")
    parallel_baseline: bool = option(
        True,
        "On CPU, train and evaluate the no-tool baseline in a second process beside the crop-tool SFT, half "
        "the threads each (sooner than one after the other: the tiny model uses two threads poorly); from 60% "
        "of its steps on, the crop-tool SFT has all the threads.",
    )
    parallel_eval: bool = option(
        True,
        "On CPU, evaluate the SFT policy (with and without its tool) in a second process beside GRPO, half the "
        "threads each; from a quarter of its steps on, GRPO has all the threads.",
    )
    grpo_steps: int = option(12, "GRPO steps after SFT (0 skips GRPO).")
    grpo_lr: float = option(1e-4, "GRPO learning rate.")
    grpo_negative_scale: float = option(
        1.0, "GRPO's weight on the samples that lost to their group (grpo.negative_scale; 0: learn from the winners)."
    )
    grpo_kl_coef: float = option(
        0.05,
        "Weight of GRPO's k3 KL to its SFT start (grpo.kl_coef; 0: no reference; docs/decisions/grpo-kl-keeps-greedy.md).",
    )
    group_size: int = option(4, "GRPO samples per prompt.")
    prompts_per_step: int = option(8, "GRPO prompts per step.")
    rollout: RolloutConfig = option(
        RolloutConfig(max_turns=3, max_new_tokens=64, max_images=4, temperature=0.7),
        "Episode limits for GRPO (its sampling temperature) and the evaluations (greedy).",
    )
    toolbox: ToolboxConfig = option(ToolboxConfig(), "Services of the search and code tools.")

    def phase_epochs(self) -> list[float]:
        """Epochs of each warm-up phase, in warmup_phases' order (warmup_epochs is one number or one per phase)."""
        if isinstance(self.warmup_epochs, list):
            return list(self.warmup_epochs)
        return [self.warmup_epochs] * len(self.warmup_phases)

    def validate(self) -> None:
        if min(self.train_rows, self.test_rows) < 2 or self.grpo_steps < 0:
            raise ValueError("need train_rows, test_rows >= 2 and grpo_steps >= 0")
        counts = (self.val_rows, self.grpo_val_every, self.grpo_val_samples, self.sampled_test_samples)
        if min(counts) < 0:
            raise ValueError(
                f"need val_rows, grpo_val_every, grpo_val_samples and sampled_test_samples >= 0, got {counts}"
            )
        if not 0 < self.grpo_keep_alpha <= 1:
            raise ValueError(f"grpo_keep_alpha must be in (0, 1], got {self.grpo_keep_alpha}")
        if (self.grpo_val_samples or self.sampled_test_samples) and self.rollout.temperature <= 0:
            raise ValueError("grpo_val_samples and sampled_test_samples sample at rollout.temperature, which is 0; "
                             "set both to 0 for greedy GRPO")  # fmt: skip
        if self.grpo_steps:  # GRPO's and its optimizer's own checks of the knobs handed to them, at load, not after SFT
            algo = GRPOAlgoConfig(group_size=self.group_size, prompts_per_step=self.prompts_per_step,
                                  negative_scale=self.grpo_negative_scale, kl_coef=self.grpo_kl_coef)  # fmt: skip
            for section in (algo, OptimConfig(lr=self.grpo_lr)):
                try:
                    section.validate()
                except ValueError as e:
                    raise ValueError(f"{e} (from the quickstart's group_size, prompts_per_step, grpo_negative_scale, "
                                     "grpo_kl_coef, grpo_lr)") from None  # fmt: skip
        epochs = self.warmup_epochs if isinstance(self.warmup_epochs, list) else [self.warmup_epochs]
        if isinstance(self.warmup_epochs, list) and len(epochs) != len(self.warmup_phases):
            raise ValueError(f"warmup_epochs lists {len(epochs)} numbers for {len(self.warmup_phases)} warmup_phases "
                             f"{self.warmup_phases}; give one per phase, or one number for all")  # fmt: skip
        if min(epochs, default=0) < 0 or self.sft_epochs <= 0:
            raise ValueError("need warmup_epochs >= 0 and sft_epochs > 0")
        unknown = set(self.warmup_phases) - set(self.PHASES)
        if unknown:
            raise ValueError(f"warmup_phases must be among {', '.join(self.PHASES)}; got {sorted(unknown)}")


@dataclass
class QuickstartConfig(ProofConfig):
    """The crop proof (``make run``): a tile whose stripes blur in the global view and read after a crop."""

    task: Literal["crop"] = option("crop", "Which proof: crop (this one, make run) or video (VideoConfig).")
    image_size: list[int] = option([672, 504], "Original image size: well above the model's view, so the stripes blur.")
    grid: int = option(2, "Tiles sit at the centers of a grid x grid layout (0 = anywhere).")
    tile: int = option(126, "Side of the target tile in original pixels (its 1-px stripes blur at any size).")
    glyph: Literal["stripes", "digit"] = option(
        "stripes", "What the tile shows: 1-px stripes in one of 4 directions (learnable from scratch) or a digit."
    )
    direct_share: float = option(0.15, "Share of rows whose tile is large enough to read without a tool.")

    def validate(self) -> None:
        super().validate()
        if len(self.image_size) != 2 or min(self.image_size) < 64:
            raise ValueError(f"image_size must be [width, height] with both >= 64, got {self.image_size}")
        if not 8 <= self.tile <= min(self.image_size) // 2:
            raise ValueError(f"tile must be in [8, {min(self.image_size) // 2}] for images of {self.image_size}")
        if not 0 <= self.direct_share <= 1:
            raise ValueError(f"direct_share must be in [0, 1], got {self.direct_share}")


@dataclass
class ClipConfig:
    duration: float = option(12.0, "Length of each clip in seconds.")
    frames: int = option(
        6, "Frames of the first view the prompt shows (rollout.frame_budget must be [frames, frames])."
    )
    fps: float = option(4.0, "Frame rate of the clips (crop_clip shows every frame of the span it cuts).")
    flash_frames: int = option(3, "Frames during which the marked square shows its color, after the marked frame.")
    size: list[int] = option([112, 84], "Frame size [width, height]; the square's side is a third of the height.")

    def validate(self) -> None:
        if self.duration <= 0 or self.fps <= 0 or self.frames < 2 or self.flash_frames < 1:
            raise ValueError(f"need duration, fps > 0, frames >= 2 and flash_frames >= 1, got {self.duration}, "
                             f"{self.fps}, {self.frames}, {self.flash_frames}")  # fmt: skip
        if int(0.8 * self.duration / self.frames * self.fps) - self.flash_frames < 1:  # as glimpse_rows places it
            raise ValueError(f"a segment of {self.duration / self.frames:.2f} s at {self.fps:g} frames/s leaves no "
                             f"room for {self.flash_frames} flash frames after the marked one: raise fps or duration")  # fmt: skip
        if len(self.size) != 2 or min(self.size) < 28:
            raise ValueError(f"size must be [width, height] with both >= 28, got {self.size}")

    def clip_frames(self) -> int:
        """Frames a one-segment crop_clip returns: every frame of the segment."""
        return round(self.duration / self.frames * self.fps)


@dataclass
class VideoConfig(ProofConfig):
    """The video proof: a first view of a clip marks when to look; only crop_clip shows what."""

    PHASES = ("perception", "grounding", "both")

    task: Literal["video"] = option("video", "Which proof: video (this one) or crop (QuickstartConfig).")
    out_dir: str = option("runs/quickstart-video", "Everything the video proof writes: data, checkpoints, report.md.")
    clip: ClipConfig = option(ClipConfig(), "The glimpse clips (data_pipelines.synthetic.video.glimpse_rows).")
    test_rows: int = option(128, "Held-out clips the policies are evaluated on.")
    warmup_rows: int = option(
        3000, "Clips (apart from train, test and val) whose rows warm up SFT (see warmup_phases)."
    )
    warmup_epochs: float | list[float] = option(
        [2.0, 0.25],
        "Passes of each warm-up phase over its rows: one number for every phase, or a list in warmup_phases' order "
        "(0 skips a phase).",
    )
    warmup_phases: list[str] = option(
        ["perception", "both"],
        "Warm-up SFT runs in order, each continuing from the last; both SFT runs start from the end. perception: read "
        "the color from the gold clip's frames shown alone; grounding: give the marked frame's time from the first "
        "view; both: the two kinds of rows together (one epoch is twice as long; docs/decisions/video-glimpse-task.md).",
    )
    sft_epochs: float = option(2.0, "SFT passes over the training mix (the no-tool baseline gets the same steps).")
    rollout: RolloutConfig = option(
        RolloutConfig(max_turns=3, max_new_tokens=64, max_images=16, temperature=0.7, frame_budget=[6, 6]),
        "Episode limits for GRPO (its sampling temperature) and the evaluations (greedy); frame_budget is the first view.",
    )

    def validate(self) -> None:
        super().validate()
        frames = self.clip.frames
        if self.rollout.frame_budget != [frames, frames]:
            raise ValueError(f"rollout.frame_budget must be [{frames}, {frames}] (clip.frames): the glimpse task marks "
                             f"one of the first view's {frames} frames, got {self.rollout.frame_budget}")  # fmt: skip
        if self.rollout.max_images < frames + self.clip.clip_frames():
            raise ValueError(f"rollout.max_images ({self.rollout.max_images}) must hold the first view ({frames}) and "
                             f"the gold clip ({self.clip.clip_frames()} frames)")  # fmt: skip


def config_class(path: str | None, overrides: list[str]) -> type[ProofConfig]:
    """The proof a YAML (its ``task``) or a ``task=`` override names: crop (``QuickstartConfig``), video or tools."""
    import yaml

    task = "crop"
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            loaded = None  # load_config reports it
        if isinstance(loaded, dict) and isinstance(loaded.get("task"), str):
            task = loaded["task"]
    for override in overrides:
        if override.startswith("task="):
            task = override.removeprefix("task=")
    classes = {"crop": QuickstartConfig, "video": VideoConfig, "tools": ToolsConfig}
    if task not in classes:
        raise ConfigError(f"{path or '<defaults>'}: task must be one of {', '.join(classes)}, got {task!r}")
    return classes[task]


@dataclass
class ToolsConfig(ProofConfig):
    """The search-and-code proof (``quickstart.tools``): MAT-style rows that need a fact of the offline corpus, an
    exact computation, a crop, or nothing, every tool offered on every row."""

    PHASES = ("perception", "grounding", "entity", "copy")

    task: Literal["tools"] = option("tools", "Which proof: tools (this one), crop (QuickstartConfig) or video.")
    out_dir: str = option("runs/quickstart-tools", "Everything the tools proof writes: data, checkpoints, report.md.")
    shares: list[float] = option(
        [0.35, 0.35, 0.15, 0.15],
        "Fractions of search, code, crop and direct rows in every split (data_pipelines.synthetic.tools.KINDS). Search "
        "and code rows are the most, as their calls copy arguments and answers; crop and direct rows the fewest.",
    )
    grpo_steps: int = option(8, "GRPO steps after SFT (0 skips GRPO).")
    grpo_val_samples: int = option(
        0,
        "Samples of each val row at GRPO's temperature in its validation (0: greedy, as the evaluations decode). Greedy "
        "here: the steps a sampled validation kept cost greedy accuracy (docs/decisions/tool-choice-task.md).",
    )
    grpo_keep_alpha: float = option(
        0.05,
        "A later GRPO step replaces the kept one only when a one-sided paired sign-flip test of their per-row greedy "
        "val accuracies gives p <= this: a lead of 3 of 64 rows kept a step that lost on test "
        "(docs/decisions/tool-choice-task.md).",
    )
    sampled_test_samples: int = option(
        4,
        "Samples of each test row at GRPO's temperature for the SFT and GRPO policies (the GRPO target's measure): one "
        "a row measured the same policy 10 points apart, more than the target's 5.",
    )
    corpus_seed: int = option(
        0, "The world: the search corpus and its facts, one for every split; GRPO and the evaluations search it."
    )
    train_rows: int = option(448, "Tool-choice rows with gold trajectories for SFT.")
    test_rows: int = option(192, "Held-out rows the policies are evaluated on (search rows ask test's held-out facts).")
    grpo_rows: int = option(
        128,
        "GRPO's prompts (and Tool-Star's), drawn apart from train, so none is a row SFT trained on: code rows have "
        "numbers of their own, crop and direct rows pictures of their own, and search rows ask train's facts on new "
        "pictures (0: train's rows).",
    )
    val_rows: int = option(
        64,
        "Held-out rows GRPO answers every grpo_val_every steps, keeping its best step (search rows ask facts held out "
        "for val, never test's); also the rows of each warm-up phase's check (0: neither).",
    )
    toolstar_steps: int = option(
        12,
        "After the proof's own runs, two more GRPO runs from its SFT policy with Tool-Star's reward alone, plain and "
        "with grpo.self_critic, this many steps each (the same seed and settings as grpo_steps' run; 0 skips them); "
        "each run's last step is evaluated and reported apart, with no target.",
    )
    warmup_rows: int = option(
        3000, "Rows of each warm-up phase (tiles for perception and grounding, pictures, copy rows), apart from train."
    )
    warmup_phases: list[str] = option(
        ["perception", "grounding", "entity", "copy"],
        "Warm-up SFT runs in order, each continuing from the last; both SFT runs start from the end. perception: read "
        "the stripes from a gold crop; grounding: give the tile's box; entity: name the pictured object's color and "
        "shape; copy: the copies a gold trajectory makes (a search query, a hit's value, whole code trajectories "
        "without picture or schemas), on made-up facts and numbers of other rows.",
    )
    warmup_epochs: float | list[float] = option(
        [0.5, 0.5, 1.5, 3.0],
        "Passes of each warm-up phase over its rows: one number, or one per warmup_phases entry (copy comes last and "
        "longest: docs/decisions/tool-choice-task.md).",
    )
    sft_epochs: float = option(
        6.0, "SFT passes over the training mix (the no-tool baseline gets the same steps): 654 steps at the default."
    )
    rollout: RolloutConfig = option(
        RolloutConfig(max_turns=3, max_new_tokens=96, max_images=4, temperature=0.7),
        "Episode limits for GRPO (its sampling temperature) and the evaluations (greedy); a gold call turn is up to "
        "about 70 tokens.",
    )

    def validate(self) -> None:
        super().validate()
        if self.toolstar_steps < 0:
            raise ValueError(f"toolstar_steps must be >= 0 (0 skips the Tool-Star runs), got {self.toolstar_steps}")
        if len(self.shares) != 4 or min(self.shares) < 0 or min(self.shares[:2]) <= 0:
            raise ValueError(f"shares must be 4 fractions >= 0 (search, code, crop, direct), search and code above 0 "
                             f"(the targets score them), got {self.shares}")  # fmt: skip
        if self.toolbox.search_corpus or self.toolbox.search_url:
            raise ValueError("leave toolbox.search_corpus and toolbox.search_url null: the tools proof serves the corpus "
                             "its rows were built with (<out_dir>/data/corpus-<corpus_seed>.jsonl)")  # fmt: skip
