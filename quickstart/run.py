"""The quickstart's stages, top to bottom: checkpoint, data, SFT (+ baseline), GRPO, evaluation, report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from quickstart.config import ProofConfig, QuickstartConfig, config_class
from quickstart.data import build_data, warmup_runs
from quickstart.parallel import Beside
from quickstart.report import SAMPLED, check_line, write_report
from vagent.config import (
    GRPOAlgoConfig,
    GRPOConfig,
    GRPODataConfig,
    GRPOValConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    SFTConfig,
    SFTDataConfig,
    TrainConfig,
    check_config,
    load_config,
)
from vagent.data import load_rows
from vagent.eval import BENCHMARKS
from vagent.eval.runner import evaluate, read_samples
from vagent.model import load_policy
from vagent.recipes import grpo, sft
from vagent.recipes.common import tool_services
from vagent.rollout import RolloutLimits
from vagent.toolbox import TOOLS, ToolContext, crop
from vagent.types import Observation

# The fraction of the crop-tool SFT's steps after which it takes the baseline's thread back. The baseline side
# (its SFT and its evaluation) ends at 0.56-0.62 of the crop-tool SFT on the 2-core machines measured. Where it
# ends later, the crop-tool SFT waits for it there; where it ends sooner, one core idles until that step.
HANDOVER = 0.6
# The fraction of GRPO's steps after which it takes back the thread of the SFT policy's evaluations beside it: the
# evaluations (192 test rows greedily with the crop tool, 192 with blind crops, 192 sampled) end between GRPO's steps
# 5 and 6 of 12.
GRPO_HANDOVER = 0.5
# The ablation row: the SFT policy with its crop tool, whose crops show the whole image instead of the region.
BLIND = "sft, blind crop"
REWARDS = {"accuracy": 1.0, "format": 0.2, "crop_iou": 0.5, "tool_bonus": 0.2, "invalid_calls": 0.2}


@dataclasses.dataclass
class _Evaluation:
    """What every test-split evaluation shares (picklable: it goes to the process beside)."""

    test_rows: list
    out: Path
    limits: RolloutLimits  # greedy
    toolbox: Any
    device: str
    samples: int = 0  # of each row, for a run named ``... SAMPLED``, at GRPO's temperature (``sampled``)
    sampled: RolloutLimits | None = None
    seed: int = 0  # every sampled run draws from it: SFT and GRPO are compared on the same random numbers
    benchmark: str = "synthetic"  # how the samples are scored (vagent.eval.BENCHMARKS)


@dataclasses.dataclass(frozen=True)
class Proof:
    """What one proof plugs into the stages ``run`` takes every proof through."""

    data_title: str  # stage 2's header
    tools: tuple[str, ...]  # the policy's tools: SFT's gold rows name them, GRPO and the evaluations offer them
    label: str  # the runs' names: "sft + <label>", "grpo + <label>"
    benchmark: str  # how the evaluations score (vagent.eval.BENCHMARKS)
    rewards: dict[str, float]  # GRPO's reward weights
    build_data: Callable[[Any, Path, Any], dict[str, Path]]  # (cfg, data dir, policy) -> the splits' files
    warmup: Callable[[Any, Path, Path, dict[str, Path]], tuple[Path, dict[str, Any]]]  # -> (checkpoint, checks)
    report: Callable[..., str]  # write_report's signature
    ablation: str | None = None  # an extra run of the SFT policy: only BLIND (blind crops, evaluate_policy)
    # more runs from the SFT policy after the proof's own, reported apart: (cfg, out, SFT model, data, proof,
    # evaluation) -> {name: (eval dir, metrics)}; timed as "comparison" (the tools proof's Tool-Star runs)
    comparison: Callable[..., dict[str, tuple[Path, dict[str, Any]]]] | None = None
    # the fractions of the SFT's and of GRPO's steps at which they take the second process's thread back: where its
    # job (the baseline's SFT and evaluation; the SFT policy's evaluations) ends on the 2-core machines measured
    handovers: tuple[float, float] = (HANDOVER, GRPO_HANDOVER)


def main(argv: list[str] | None = None) -> int:
    """``python -m quickstart [--config YAML] [key=value ...]`` (``make run``, ``vagent quickstart``): the proof the
    YAML's ``task`` names (crop by default)."""
    from quickstart.tools import SEARCH_CODE
    from quickstart.video import VIDEO

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    cfg = load_config(config_class(config_path, argv), config_path, argv)
    return run(cfg, {"crop": CROP, "video": VIDEO, "tools": SEARCH_CODE}[cfg.task])


def run(cfg: Any, proof: Proof) -> int:
    """Take ``proof`` through the stages: checkpoint, data, SFT (+ baseline), GRPO, evaluation, report."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_start = time.perf_counter()

    def stage(n: int, name: str, key: str | None = None):
        """Print the stage's header; the returned callable records its time under ``key``."""
        print(f"\n[{n}/6] {name}  ({time.perf_counter() - t_start:.0f}s so far)", flush=True)
        t = time.perf_counter()
        return lambda label=key: times.__setitem__(label, time.perf_counter() - t)

    done = stage(1, "tiny checkpoint", "checkpoint")
    base = tiny_checkpoint(cfg, out)
    policy = load_policy(base, device=_device(cfg))  # its pixel budget and coordinate convention
    done()
    done = stage(2, proof.data_title, "data")
    data = proof.build_data(cfg, out / "data", policy)
    del policy
    done()
    done = stage(3, f"SFT: warm-up ({', '.join(cfg.warmup_phases)}); from it the {proof.label}-tool cold start and "
                    "the no-tool baseline", "sft")  # fmt: skip
    evaluation = _Evaluation(load_rows(data["test"]), out, greedy_limits(cfg), cfg.toolbox, _device(cfg),
                             cfg.sampled_test_samples, _limits(cfg), cfg.seed, proof.benchmark)  # fmt: skip
    start, checks = proof.warmup(cfg, out, base, data)
    sft_model, notool_model, notool_eval = _sft_stage(cfg, out, start, data, evaluation, proof.handovers[0])
    done()
    done = stage(4, "GRPO from the SFT policy")
    sft_name, grpo_name, tools = f"sft + {proof.label}", f"grpo + {proof.label}", list(proof.tools)
    # The SFT policy's evaluations run beside GRPO (on CPU, with parallel_eval), the rest after it.
    sft_runs = {sft_name: (sft_model, tools), **({proof.ablation: (sft_model, tools)} if proof.ablation else {})}
    if cfg.sampled_test_samples and cfg.grpo_steps:  # the GRPO target's measure: sampled as GRPO samples
        sft_runs[sft_name + SAMPLED] = (sft_model, tools)
    beside = Beside.start(cfg.parallel_eval and cfg.grpo_steps > 0, _device(cfg), out / "eval" / "log-sft.txt",
                          f"the SFT policy's evaluations ({', '.join(sft_runs)})", _evaluate_runs, sft_runs,
                          evaluation)  # fmt: skip
    try:
        grpo_model = None
        if cfg.grpo_steps:
            grpo_model = grpo.train(grpo_config(cfg, out, sft_model, data, proof),
                                    before_step=beside.hand_over(proof.handovers[1]) if beside else None)  # fmt: skip
        done("grpo (SFT evaluated beside it)" if beside else "grpo")
        done = stage(5, "evaluation on the held-out test split", "eval")
        sft_evals = beside.result() if beside else _evaluate_runs(sft_runs, evaluation)
    finally:
        if beside:
            beside.stop()
    results = {**sft_evals, "no-tool baseline": notool_eval or evaluate_policy("no-tool baseline", notool_model, [],
                                                                         evaluation)}  # fmt: skip
    if grpo_model is not None:  # when it kept its SFT start, that policy's evaluation is already there
        kept_start = _same_weights(grpo_model, sft_model)
        if kept_start:
            print(f"GRPO kept its SFT start (no later step won on the val rows): its evaluations are {sft_name}'s")
        for name in (grpo_name, *([grpo_name + SAMPLED] if cfg.sampled_test_samples else [])):
            start_name = name.replace("grpo", "sft")
            results[name] = results[start_name] if kept_start else evaluate_policy(name, grpo_model, tools, evaluation)
    order = (grpo_name, sft_name, "no-tool baseline", proof.ablation, grpo_name + SAMPLED, sft_name + SAMPLED)
    results = {name: results[name] for name in order if name in results}
    done()
    if proof.comparison:
        done = stage(5, "more runs from the SFT policy, reported apart", "comparison")
        results.update(proof.comparison(cfg, out, sft_model, data, proof, evaluation))
        done()
    done = stage(6, "report", "report")
    times["report"] = 0.0
    report = proof.report(cfg, out, results, evaluation.test_rows, checks, times, time.perf_counter() - t_start)
    done()
    print(report)
    print(f"\nwrote {out / 'report.md'}; open the trajectories.html files it links to see what the policy looked at.")
    return 0


def tiny_checkpoint(cfg: ProofConfig, out: Path) -> Path:
    """``model.path``, or the tiny random checkpoint under ``out``, built once (rebuilt when its recipe changed)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    tiny = cfg.tiny
    target = out / f"tiny-{tiny.family}-{tiny.size}"
    recipe = {"family": tiny.family, "size": tiny.size, "vocab": tiny.vocab, "vocab_size": tiny.vocab_size,
              "seed": tiny.seed, "rope_theta": tiny.rope_theta, "min_pixels": cfg.model.min_pixels,
              "max_pixels": cfg.model.max_pixels}  # fmt: skip
    marker = target / "vagent_tiny.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == recipe):
        from vagent.tiny_model import build_tiny_checkpoint

        print(f"building a random tiny {tiny.family} checkpoint ({tiny.size}) in {target} ...", flush=True)
        build_tiny_checkpoint(target, **recipe)
    return target


def _device(cfg: ProofConfig) -> str:
    return cfg.model.device or "cpu"


def _limits(cfg: ProofConfig) -> RolloutLimits:
    """The rollout's episode limits, sampled at GRPO's temperature."""
    return RolloutLimits(
        **{
            k: v
            for k, v in dataclasses.asdict(cfg.rollout).items()
            if k in RolloutLimits.fields()  # the episode's limits and sampling; the rest picks the engine
        },
        seed=cfg.seed,
    )


def greedy_limits(cfg: ProofConfig) -> RolloutLimits:
    """The evaluations' episode limits: the rollout's, sampled greedily."""
    return dataclasses.replace(_limits(cfg), temperature=0.0)


def sft_config(cfg: ProofConfig, out_dir: Path, model: Path, train: Path, epochs: float,
               tools: list[str] | None = None) -> SFTConfig:  # fmt: skip
    """One of the quickstart's SFT runs (warm-up phases, the crop-tool cold start, the no-tool baseline)."""
    # a video row's prompt shows the first view the rollout shows (None: the profile's own view)
    data = SFTDataConfig(train=str(train), micro_batch_size=8, frame_budget=cfg.rollout.frame_budget)
    if tools is not None:
        data.tools = tools
    return check_config(SFTConfig(
        out_dir=str(out_dir), seed=cfg.seed, model=ModelConfig(path=str(model), device=_device(cfg)), data=data,
        optim=OptimConfig(lr=cfg.sft_lr, warmup_steps=10, min_lr_ratio=0.05),
        train=TrainConfig(epochs=epochs, precision="fp32", save_every=0, resume="auto"),
    ))  # fmt: skip


def grpo_config(cfg: ProofConfig, out: Path, model: Path, data: dict[str, Path], proof: Proof) -> GRPOConfig:
    """GRPO from the SFT policy, checking itself on the val rows every few steps and keeping its best."""
    val = GRPOValConfig()
    if cfg.val_rows:
        val = GRPOValConfig(
            rows=str(data["val"]), every=cfg.grpo_val_every, keep_best=True, keep_alpha=cfg.grpo_keep_alpha
        )
        if cfg.grpo_val_samples:  # sampled as GRPO samples: the policy it optimizes
            val.temperature, val.samples = cfg.rollout.temperature, cfg.grpo_val_samples
    algo = GRPOAlgoConfig(group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step, micro_batch_size=8,
                          rollout_batch_size=cfg.group_size * cfg.prompts_per_step,
                          negative_scale=cfg.grpo_negative_scale, kl_coef=cfg.grpo_kl_coef)  # fmt: skip
    prompts = data.get("grpo", data["train"])  # a proof may draw GRPO's prompts apart from its SFT rows
    return check_config(GRPOConfig(
        out_dir=str(out / "grpo"), seed=cfg.seed, model=ModelConfig(path=str(model), device=_device(cfg)),
        data=GRPODataConfig(train=str(prompts), tools=list(proof.tools)), rollout=dataclasses.replace(cfg.rollout),
        grpo=algo, val=val, rewards=RewardConfig(weights=dict(proof.rewards)), optim=OptimConfig(lr=cfg.grpo_lr),
        train=TrainConfig(max_steps=cfg.grpo_steps, precision="fp32", save_every=0, resume="auto"),
        toolbox=dataclasses.replace(cfg.toolbox),  # the proof's search corpus, if it has one
    ))  # fmt: skip


def warmup_phases(cfg: ProofConfig, out: Path, base: Path, data: dict[str, Path],
                  check: Callable[[str, str, Path], dict[str, Any]], tools: list[str] | None = None,
                  ) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """The warm-up SFT runs in order, each from the last, each phase checked right after it (a later phase wears
    its skill down): (the last checkpoint, every ``check(run, phase, checkpoint)``'s results by name)."""
    start, checks = base, {}
    for run, phase, epochs in warmup_runs(cfg):  # shared: the baseline gets the same budget
        start = sft.train(sft_config(cfg, out / run, start, data[f"warmup_{phase}"], epochs, tools=tools))
        checks.update(check(run, phase, start))
    return start, checks


def greedy_scores(model_dir: Path, rows: list, run_dir: Path, limits: RolloutLimits, device: str, label: str,
                  group: Callable[[dict], str]) -> tuple[dict[str, list[float]], list[dict]]:  # fmt: skip
    """A warm-up checkpoint answering ``rows`` without tools, scored by ``synthetic``: (each sample's score by
    ``group(sample)``, the samples)."""
    evaluate(load_policy(model_dir, device=device), BENCHMARKS["synthetic"], rows, run_dir, tools=[], limits=limits,
             batch_size=16, label=label)  # fmt: skip
    samples = read_samples(run_dir / "samples.jsonl")
    scores: dict[str, list[float]] = {}
    for s in samples:
        scores.setdefault(group(s), []).append(s["accuracy"])
    return scores, samples


def _warmup(cfg: QuickstartConfig, out: Path, base: Path, data: dict[str, Path]) -> tuple[Path, dict[str, Any]]:
    """The crop proof's warm-up phases, perception checked on the glyph (its name in ``cfg.glyph``)."""
    from data_pipelines.synthetic.zoom import GLYPHS

    what = GLYPHS[cfg.glyph][0]  # "stripes", "digit": what the perception check reads

    def check(run: str, phase: str, start: Path) -> dict[str, Any]:
        if f"check_{phase}" not in data:
            return {}
        result = _warmup_check(run, phase, what, start, data[f"check_{phase}"], out, _device(cfg))
        return {run: result} if result else {}

    return warmup_phases(cfg, out, base, data, check)


def _sft_stage(cfg: ProofConfig, out: Path, start: Path, data: dict[str, Path], evaluation: _Evaluation,
               handover: float) -> tuple[Path, Path, tuple[Path, dict] | None]:  # fmt: skip
    """The crop-tool cold start, and beside it (on CPU) the no-tool baseline's SFT and evaluation, whose thread the
    cold start takes back at ``handover`` of its steps: (the SFT model, the baseline model, the baseline's evaluation
    if it ran beside)."""
    notool = sft_config(cfg, out / "sft-notool", start, data["sft_mix_notool"], cfg.sft_epochs, tools=[])
    baseline = Beside.start(cfg.parallel_baseline, _device(cfg), out / "sft-notool" / "log.txt",
                            "the no-tool baseline's SFT and evaluation", _baseline, notool, evaluation)  # fmt: skip
    try:
        sft_model = sft.train(sft_config(cfg, out / "sft", start, data["sft_mix"], cfg.sft_epochs),
                              before_step=baseline.hand_over(handover) if baseline else None)  # fmt: skip
        notool_model, notool_eval = baseline.result() if baseline else _baseline(notool, None)
    finally:
        if baseline:
            baseline.stop()
    return sft_model, notool_model, notool_eval


def _same_weights(a: Path, b: Path) -> bool:
    """Whether two HF model dirs hold the same weight files, byte for byte."""
    from vagent.training.checkpoint import file_digest

    files = sorted(p.name for p in Path(a).glob("*.safetensors"))
    return (
        bool(files)
        and files == sorted(p.name for p in Path(b).glob("*.safetensors"))
        and all(file_digest(Path(a) / f) == file_digest(Path(b) / f) for f in files)
    )


def evaluate_policy(
    name: str, model_dir: Path, tools: list[str], evaluation: _Evaluation
) -> tuple[Path, dict[str, Any]]:
    """One policy on the test split, greedy (a name ending in ``SAMPLED``: ``evaluation.samples`` a row at GRPO's
    temperature): (its eval dir, its metrics). ``BLIND`` runs with ``blind_crop``."""
    run_dir = evaluation.out / "eval" / name.replace(" ", "-").replace(",", "").replace("+", "with")
    sampled = name.endswith(SAMPLED)
    policy = load_policy(model_dir, device=evaluation.device)
    if sampled:
        torch.manual_seed(evaluation.seed)
    with blind_crop() if name == BLIND else contextlib.nullcontext():
        return run_dir, evaluate(policy, BENCHMARKS[evaluation.benchmark], evaluation.test_rows, run_dir, tools=tools,
                                 limits=evaluation.sampled if sampled else evaluation.limits,
                                 n_samples=evaluation.samples if sampled else 1, batch_size=16,
                                 services=tool_services(evaluation.toolbox), label=name)  # fmt: skip


@contextlib.contextmanager
def blind_crop() -> Iterator[None]:
    """Within it, ``crop`` checks and answers every call as before, but its image is the whole image the call
    named, resized to the crop's size: the prompt, the calls and the number of image tokens stay those the policy
    was trained on, and only what a crop shows closer is gone. The ablation says whether the answers come from the
    crops' pixels (a policy that reads the global view, or guesses, loses nothing)."""

    def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
        observation = crop.call(arguments, context)
        if not observation.ok:
            return observation
        whole = context.images[observation.metadata["image_index"]]
        return dataclasses.replace(observation, images=[whole.convert("RGB").resize(observation.images[0].size)])

    blind = types.SimpleNamespace(NAME=crop.NAME, SCHEMA=crop.SCHEMA, call=call)
    with mock.patch.dict(TOOLS, {crop.NAME: blind}):
        yield


def _warmup_check(run: str, phase: str, what: str, model_dir: Path, rows_path: Path, out: Path,
                  device: str) -> dict | None:  # fmt: skip
    """A warm-up phase's checkpoint on the val images' rows of that phase (the grounding phase: the tile's box;
    perception: the glyph, ``what``, read from the gold crop), greedy. Each phase's loss sits on a plateau (the format
    learned, the skill not) for a few hundred steps before it drops, after a number of steps that varies with the
    draw; a phase that stops on it leaves its skill to the crop-tool SFT (docs/decisions/perception-before-grounding.md). Returns the
    scores (IoU or accuracy) per gold answer and the distinct answers; None when no val image has a small tile."""
    if not rows_path.stat().st_size:
        return None
    limits = RolloutLimits(max_turns=1, max_new_tokens=32, temperature=0.0)
    rows = load_rows(rows_path)
    scores, samples = greedy_scores(model_dir, rows, out / "eval" / run, limits, device, f"{run}: {len(rows)} val rows",
                                    lambda s: str(s["gold"][0]) if phase == "perception" else "box")  # fmt: skip
    check = {"phase": phase, "what": what, "scores": scores,
             "answers": len({str(s["prediction"]) for s in samples if s["prediction"] is not None})}  # fmt: skip
    print(f"{run}: {check_line(check)}", flush=True)
    return check


def _evaluate_runs(runs: dict[str, tuple[Path, list[str]]], evaluation: _Evaluation) -> dict[str, tuple[Path, dict]]:
    """``evaluate_policy`` each of ``runs`` (name: (model dir, tools)), one after the other."""
    return {name: evaluate_policy(name, model_dir, tools, evaluation) for name, (model_dir, tools) in runs.items()}


def _baseline(cfg: SFTConfig, evaluation: _Evaluation | None) -> tuple[Path, tuple[Path, dict] | None]:
    """Train the no-tool baseline and, given ``evaluation``, evaluate it: (its model dir, its evaluation)."""
    model_dir = sft.train(cfg)
    return model_dir, evaluate_policy("no-tool baseline", model_dir, [], evaluation) if evaluation else None


# The crop proof (``make run``).
CROP = Proof("synthetic zoom tasks", ("crop",), "crop", "synthetic", REWARDS, build_data, _warmup, write_report, BLIND)
