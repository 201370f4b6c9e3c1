"""The Gradio demo: upload an image or a video, ask a question, and watch the policy think with its tools.

    vagent demo [--model DIR] [--host 127.0.0.1] [--port 7860]
    python demo/app.py [--model DIR] ...

The trajectory streams turn by turn: each turn's reasoning, every tool call as a sentence, the crops, zooms
and frames the tools returned (with the boxes the model looked at drawn on the original), the answer, and
the time and tokens of every turn. Without ``--model`` the demo takes the quickstart's trained checkpoint
(``runs/quickstart``) if there is one, else a random tiny model, and says so.

Safe to expose on a network: code runs only in the bubblewrap sandbox (the ``code`` tool is not offered
without it); upload size, image pixels, video length, question length, turns and tokens are capped with a
message; requests queue (one episode on the model at a time); a failing request shows its error to that user
and the app goes on serving. Needs the ``demo`` extra: ``pip install -e '.[demo]'``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python demo/app.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.episode import (
    DemoLimits,
    Looked,
    UploadError,
    annotate,
    build_task,
    check_upload,
    clamp_limits,
    close_backend,
    render_turn,
    stream_episode,
)
from vagent.agents import PROFILES
from vagent.model import Policy, PolicyLoadError, load_policy
from vagent.rollout.backend import GenerationBackend
from vagent.rollout.export import save_png_once
from vagent.toolbox import TOOLS, ToolServices

logger = logging.getLogger("vagent.demo")

IMAGE_TOOLS = ["crop", "zoom_in", "rotate", "flip", "enhance", "draw", "code", "search"]
VIDEO_TOOLS = ["sample_frames", "crop_clip"]
RANDOM_MODEL_WARNING = (
    "**This is a random tiny model: it writes nonsense.** It shows how the demo works, nothing more. "
    "Train one with `make run` (the quickstart), or point the demo at a real checkpoint: "
    "`vagent demo --model /path/to/Qwen2.5-VL-7B-Instruct` (any local Qwen2-VL / Qwen2.5-VL / Qwen3-VL dir)."
)


@dataclass
class Served:
    """What the app serves: the policy, where it came from, the tools it may offer and their services."""

    policy: Policy
    model_dir: Path
    note: str
    tools: list[str]
    services: ToolServices = field(default_factory=ToolServices)
    limits: DemoLimits = field(default_factory=DemoLimits)
    examples: list[list[Any]] = field(default_factory=list)
    agent: str = "vagent"  # the protocol the policy speaks (vagent.agents.PROFILES)
    backend: GenerationBackend | None = None  # --backend vllm: the engine every episode generates on; None: HF


def pick_model(model: str | None, runs: Path, size: str = "tiny") -> tuple[Path, str]:
    """The checkpoint to serve and a line about it for the page: ``--model``, else the quickstart's GRPO or
    SFT policy, else a random checkpoint of preset ``size`` built under ``runs/demo`` (with a warning that it is
    random)."""
    if model:
        return Path(model), f"Model: `{model}`."
    for stage in ("grpo", "sft"):
        trained = runs / "quickstart" / stage / "model"
        if (trained / "config.json").is_file():
            return trained, (
                f"Model: the quickstart's {stage.upper()} policy (`{trained}`), a tiny model trained for minutes on "
                "synthetic zoom tasks; expect it to crop and answer, often wrongly. Point the demo at a real "
                "checkpoint with `--model DIR`."
            )
    from vagent.tiny_model import build_tiny_checkpoint

    tiny = runs / "demo" / f"{size}-random"
    if not (tiny / "config.json").is_file():
        print(f"no --model and no quickstart checkpoint: building a random {size} model in {tiny} ...", flush=True)
        build_tiny_checkpoint(tiny, size=size, min_pixels=3136, max_pixels=50176)
    return tiny, RANDOM_MODEL_WARNING


def make_examples(policy: Policy, out: Path) -> list[list[Any]]:
    """Example inputs from the synthetic benchmarks (``data_pipelines/synthetic``), made once under ``out``:
    two zoom images (a striped tile as in configs/quickstart/tiny_cpu.yaml, a digit tile) and a short video."""
    from data_pipelines.synthetic.video import video_rows
    from data_pipelines.synthetic.zoom import zoom_rows

    rows = [
        *zoom_rows(out / "stripes", 1, seed=7, size=(672, 504), tile=126, clutter=30, distractors=0, direct_share=0.0,
                   grid=2, glyph="stripes", **policy.frame),
        *zoom_rows(out / "digit", 1, seed=3, direct_share=0.0, **policy.frame),
        *video_rows(out / "video", 1, seed=5),
    ]  # fmt: skip
    return [[(row.images or row.videos)[0], row.question, row.tools] for row in rows]


def services_for(search_corpus: str | None) -> tuple[list[str], ToolServices]:
    """The tools this server can offer, and the search backend and code sandbox behind them."""
    from vagent.toolbox.sandbox import Sandbox

    sandbox = Sandbox(timeout_s=10.0, memory_mb=1024, allow_unsandboxed=False)  # never unsandboxed when exposed
    search = None
    if search_corpus:
        from vagent.toolbox.search import BM25Backend

        search = BM25Backend(search_corpus)
    tools = [t for t in IMAGE_TOOLS + VIDEO_TOOLS if t in TOOLS]
    if not sandbox.available:
        tools.remove("code")
        logger.warning("bubblewrap is not available: the `code` tool is not offered")
    if search is None:
        tools.remove("search")
    return tools, ToolServices(search=search, sandbox=sandbox)


# -- the request handler ------------------------------------------------------------------------------------


@functools.cache
def _image_dir() -> Path:
    import atexit
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="vagent-demo-"))  # under the temp dir, which Gradio may serve from
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _png(image):
    """A PIL image as a PNG file named by its pixels, written once and atomically (``save_png_once``); None stays None.

    Gradio saves a PIL image to its cache on every yield, rewriting the same file in place; a streaming handler
    re-yields every earlier image each turn, so the browser could fetch a file mid-rewrite and the server fail
    with "Too much data for declared Content-Length". A path is copied to the cache once, atomically."""
    return None if image is None else str(save_png_once(image, _image_dir(), "image"))


def _gradio_message(item: dict[str, Any]) -> dict[str, Any]:
    import gradio as gr
    from PIL import Image

    content = item["content"]
    if isinstance(content, Image.Image):
        content = gr.Image(value=_png(content), label=item.get("caption"), show_label=False)
    return {"role": item["role"], "content": content}


def answer(served: Served, file: str | None, question: str, tools: list[str], temperature: float, max_turns: int,
           max_new_tokens: int, seed: int):  # fmt: skip
    """The streaming handler: yields (chat history, the image with the boxes looked at, status) after each turn."""
    import gradio as gr

    history: list[dict[str, Any]] = []
    try:
        upload = check_upload(file, served.limits)
        tools = [t for t in (tools or []) if t in served.tools]
        task = build_task(upload, question, tools, served.limits)
        limits = clamp_limits(served.limits, temperature, max_turns, max_new_tokens)
    except UploadError as e:
        yield history, None, f"**Error:** {e}"
        return
    if upload.image is not None:
        shown, looked = upload.image, Looked(image=upload.image)
    else:  # frames stand in for the video: browsers play few of the codecs people upload
        shown, looked = upload.poster, Looked(duration=upload.duration_s)

    def seen() -> str | None:  # the original with the boxes looked at so far, as a file
        return _png(looked.picture())

    history += [{"role": "user", "content": gr.Image(value=_png(shown), show_label=False)},
                {"role": "user", "content": task.question}]  # fmt: skip
    yield history, seen(), f"Running on `{served.model_dir.name}` with tools: {', '.join(tools) or 'none'} …"
    turn, t0 = 0, time.perf_counter()
    try:
        for event in stream_episode(served.policy, task, limits, served.services, seed=int(seed), agent=served.agent,
                                    backend=served.backend):  # fmt: skip
            if event.kind == "turn":
                turn += event.message.role == "assistant"
                looked.add(event.observation)
                history += [_gradio_message(m) for m in render_turn(event, turn, served.agent)]
                yield history, seen(), f"Turn {turn} · {time.perf_counter() - t0:.1f} s …"
            elif event.kind == "done":
                yield history, seen(), _summary(event.trajectory, time.perf_counter() - t0)
            else:
                yield history, seen(), f"**Error:** the episode failed: {event.error}"
    except Exception as e:  # rendering bugs too: this user sees an error, the server goes on
        logger.exception("demo request failed")
        yield history, seen(), f"**Error:** {type(e).__name__}: {e}"


def _summary(trajectory, seconds: float) -> str:
    calls = Counter(r.name or "malformed" for r in trajectory.tool_results)
    failed = sum(1 for r in trajectory.tool_results if r.error)
    sampled = sum(trajectory.loss_mask)
    answer = "(none)" if trajectory.answer is None else trajectory.answer or "(empty)"
    return (
        f"**Done** in {seconds:.1f} s · stop: `{trajectory.stop_reason}` · turns: {trajectory.metrics.get('turns', 0)} · "
        f"tool calls: {', '.join(f'{k} ×{v}' for k, v in calls.items()) or 'none'}"
        + (f" ({failed} failed)" if failed else "")
        + f" · {sampled} tokens sampled, {len(trajectory.token_ids)} in context · answer: **{answer}**"
    )


def on_upload(served: Served, file: str | None, current: list[str]):
    """When a file arrives: check it at once (the status says what is wrong with a bad one), show an image in the
    "where the model looked" panel, and offer the video tools for a video or the crop tool for an image (unless
    the user already chose tools of the right kind)."""
    import gradio as gr

    if not file:
        return current, None, gr.update()
    try:
        upload = check_upload(file, served.limits)
    except UploadError as e:
        return current, None, f"**Error:** {e}"
    kind = VIDEO_TOOLS if upload.kind == "video" else [t for t in served.tools if t not in VIDEO_TOOLS]
    if not (current and all(t in kind for t in current)):
        current = [t for t in (VIDEO_TOOLS if upload.kind == "video" else ["crop"]) if t in served.tools]
    preview = annotate(upload.image, []) if upload.image is not None else upload.poster
    what = (
        f"{upload.image.width}x{upload.image.height} image"
        if upload.image is not None
        else f"{upload.duration_s:.1f} s video"
    )
    return current, preview, f"Ready: a {what}. Ask a question."


# -- the page -------------------------------------------------------------------------------------------------


def build_app(served: Served):
    import gradio as gr

    limits = served.limits
    with gr.Blocks(title="vagent demo: thinking with images", analytics_enabled=False) as app:
        gr.Markdown(
            "# vagent · thinking with images and videos\n"
            "Upload an image or a video, ask a question and watch the policy reason, call tools and look at "
            "what they returned. " + served.note
        )
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                upload = gr.File(label="Image or video", file_types=["image", "video"], type="filepath",
                                 elem_id="upload", height=80)  # fmt: skip
                # Crop boxes on the image; for a video, its timeline with the spans and frames sampled.
                looked = gr.Image(label="Where the model looked", interactive=False, height=300, elem_id="looked")
                question = gr.Textbox(label="Question", lines=2, max_lines=6, elem_id="question",
                                      placeholder="e.g. What digit is written on the small red tile?")  # fmt: skip
                tools = gr.CheckboxGroup(served.tools, value=["crop"] if "crop" in served.tools else [],
                                         label="Tools the model may call", elem_id="tools")  # fmt: skip
                with gr.Accordion("Sampling", open=False):
                    temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                    max_turns = gr.Slider(1, limits.max_turns, value=min(4, limits.max_turns), step=1,
                                          label="Max turns")  # fmt: skip
                    max_new_tokens = gr.Slider(16, limits.max_new_tokens, value=min(256, limits.max_new_tokens),
                                               step=16, label="Max new tokens per turn")  # fmt: skip
                    seed = gr.Number(0, precision=0, label="Seed")
                run = gr.Button("Ask", variant="primary", elem_id="ask")
            with gr.Column(scale=3, min_width=420):
                chat = gr.Chatbot(
                    label="Trajectory", height=680, elem_id="trajectory", group_consecutive_messages=False
                )
                status = gr.Markdown(
                    f"Limits: uploads up to {limits.max_upload_mb:g} MB, images up to {limits.max_image_pixels:,} "
                    f"pixels, videos up to {limits.max_video_s:g} s, {limits.max_turns} turns.",
                    elem_id="status",
                )
        if served.examples:
            gr.Examples(served.examples, [upload, question, tools], label="Examples (synthetic benchmark tasks)")
        upload.change(
            functools.partial(on_upload, served), [upload, tools], [tools, looked, status], concurrency_limit=None
        )
        inputs = [upload, question, tools, temperature, max_turns, max_new_tokens, seed]
        for trigger in (run.click, question.submit):
            trigger(functools.partial(answer, served), inputs, [chat, looked, status], concurrency_limit=1,
                    concurrency_id="policy")  # fmt: skip
    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vagent demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint dir. Default: the quickstart's policy, else a random tiny model.")
    p.add_argument("--runs", default="runs", help="Where the quickstart wrote its runs (default: %(default)s).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address; 0.0.0.0 exposes it (default: %(default)s).")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--device", help="cuda / cpu (default: CUDA when available).")
    p.add_argument(
        "--backend",
        default="hf",
        choices=["hf", "vllm"],
        help="What generates: hf (vagent's own engine) or vllm (needs vLLM installed; default: %(default)s).",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="--backend vllm on a GPU: the engine's share of the device memory (%(default)s).")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="--backend vllm: the model sharded over this "
                   "many devices, one vLLM worker process each (%(default)s).")  # fmt: skip
    p.add_argument("--search-corpus", help="JSONL corpus (title, text, url) that enables the offline `search` tool.")
    p.add_argument("--max-upload-mb", type=float, default=DemoLimits.max_upload_mb)
    p.add_argument("--max-image-pixels", type=int, default=DemoLimits.max_image_pixels)
    p.add_argument("--max-video-s", type=float, default=DemoLimits.max_video_s)
    p.add_argument("--max-turns", type=int, default=DemoLimits.max_turns)
    p.add_argument("--max-queue", type=int, default=16, help="Requests waiting beyond this are turned away.")
    p.add_argument("--share", action="store_true", help="Gradio share link (needs the internet).")
    p.add_argument("--agent", default="vagent", choices=sorted(PROFILES),
                   help="Agent profile the checkpoint speaks (docs/guide/agents.md), e.g. deepeyes. Default: vagent.")  # fmt: skip
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be a positive integer, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.backend != "vllm":
        p.error("--tensor-parallel-size shards vLLM's engine: add --backend vllm")
    return args


def load(args: argparse.Namespace) -> Served:
    """Everything the app serves, loaded: the policy, its tools and, under ``--backend vllm``, the engine.

    Raises:
        PolicyLoadError: the checkpoint does not load, or vLLM cannot run it here (one line with the remedy).
    """
    # vLLM's CPU attention takes head sizes from 32: a random stand-in for it is the `small` preset
    size = "small" if args.backend == "vllm" else "tiny"
    model_dir, note = pick_model(args.model, Path(args.runs), size=size)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from vagent.rollout.vllm_backend import policy_placement

    try:  # with vLLM on a GPU: the engine holds the weights
        _, placement = policy_placement(args.backend, device, None)
    except ValueError as e:  # vLLM on another GPU than its process's
        raise PolicyLoadError(f"--backend vllm: {e}") from None
    policy = load_policy(model_dir, **placement)
    tools, services = services_for(args.search_corpus)
    tools = [t for t in tools if t in PROFILES[args.agent].tools]  # what the agent's protocol can call
    limits = DemoLimits(max_upload_mb=args.max_upload_mb, max_image_pixels=args.max_image_pixels,
                        max_video_s=args.max_video_s, max_turns=args.max_turns)  # fmt: skip
    examples = make_examples(policy, Path(args.runs) / "demo" / "examples")
    backend = None
    if args.backend == "vllm":
        try:
            from vagent.rollout.vllm_backend import VLLMBackend
        except ImportError as e:
            raise PolicyLoadError(f"--backend vllm needs vLLM installed (pip install -e '.[vllm]'): {e}") from None
        try:  # one episode at a time (the app's queue): a handful of rows covers its turns
            backend = VLLMBackend.for_policy(policy, device=device, max_model_len=limits.max_total_tokens, max_num_seqs=4,
                                             max_images=limits.max_images,
                                             gpu_memory_utilization=args.gpu_memory_utilization, sleep=False,
                                             tensor_parallel_size=args.tensor_parallel_size, tp_ranks=False)  # fmt: skip
        except ValueError as e:
            raise PolicyLoadError(f"--backend vllm: {e}") from None
        note += " Generating on vLLM."
    return Served(policy, model_dir, note, tools, services, limits, examples, agent=args.agent, backend=backend)


def serve(args: argparse.Namespace):
    """Load everything and build the app (not launched): the CLI and the tests share this."""
    served = load(args)
    return served, build_app(served)


def main(argv: list[str] | None = None) -> int:
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("vagent demo: error: the demo needs Gradio; install it with: pip install -e '.[demo]'", file=sys.stderr)
        return 2
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        served = load(args)
    except PolicyLoadError as e:
        print(f"vagent demo: error: {e}", file=sys.stderr)
        return 2
    try:
        app = build_app(served)
        print(f"serving {served.model_dir} on http://{args.host}:{args.port} on {args.backend} "
              f"(tools: {', '.join(served.tools)})")  # fmt: skip
        app.queue(default_concurrency_limit=1, max_size=args.max_queue)
        app.launch(server_name=args.host, server_port=args.port, share=args.share,
                   max_file_size=f"{served.limits.max_upload_mb:g}mb", allowed_paths=[str(Path(args.runs).resolve())],
                   show_error=True)  # fmt: skip
    finally:  # the engine ends with the demo: Ctrl-C, or an app that failed to start
        close_backend(served.backend)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
