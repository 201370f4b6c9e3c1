"""``vagent serve``: an OpenAI-compatible HTTP server over the rollout engine's batched backend (a leaf).

    vagent serve --model CKPT [--host 127.0.0.1] [--port 8000] [--agent] [--allowed-media-root DIR] [--max-queue N]

See docs/guide/serving.md. Needs the ``serve`` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``vagent serve`` flags."""
    p.add_argument("--model", required=True, help="HF checkpoint dir (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).")
    p.add_argument("--served-model-name", help="The `model` id clients send (default: the checkpoint dir's name).")
    p.add_argument("--host", default="127.0.0.1", help="Interface to listen on (%(default)s: this machine only).")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--agent", action="store_true",
                   help="Run vagent's tool loop server-side; answers carry the trajectory.")  # fmt: skip
    p.add_argument("--agent-profile", default="vagent",
                   help="With --agent: the protocol the loop speaks (vagent.agents.PROFILES: vagent, deepeyes, "
                   "pixel-reasoner, ...): its prompt, call syntax, tool mapping and observations.")  # fmt: skip
    p.add_argument("--tools", default="crop", help="Comma-separated tools agent mode offers (%(default)s).")
    p.add_argument("--max-turns", type=_positive, help="Assistant turns per agent episode (default: the agent "
                   "profile's own, 4 for vagent); any budget, e.g. 32 for a policy trained at 6 (turn scaling).")  # fmt: skip
    p.add_argument("--max-images", type=_positive, help="Images per agent episode, prompt included (default: the "
                   "profile's own, 8 for vagent); a turn budget that crops every turn needs turns + 1.")  # fmt: skip
    p.add_argument("--tool-workers", type=_positive, default=8, help="With --agent: threads running tool calls, "
                   "shared by the episodes of a batch; a call's timeout counts from when one starts it (%(default)s).")  # fmt: skip
    p.add_argument("--allowed-media-root", action="append", default=[], type=Path,
                   help="Local image paths must be under this dir; repeat for several. Default: data: URLs only.")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=64, help="Requests held at once; more get 429 (%(default)s).")
    p.add_argument("--max-model-len", type=int, help="Prompt + completion tokens (default: the model's positions).")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="Completion budget of requests that set no max_tokens (%(default)s).")  # fmt: skip
    p.add_argument("--max-image-pixels", type=int, default=40_000_000,
                   help="Refuse bigger images (decompression-bomb guard, %(default)s).")  # fmt: skip
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's). On a busy CPU fewer threads can be much faster.")  # fmt: skip
    p.add_argument("--device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="What generates: hf (vagent's own engine) "
                   "or vllm (a vLLM engine over the checkpoint; a seeded request's turns carry their own seed). "
                   "Default: %(default)s.")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="--backend vllm on a GPU: the engine's share of the device memory (%(default)s).")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=_positive, default=1, help="--backend vllm: the model sharded over "
                   "this many devices, one vLLM worker process each (%(default)s).")  # fmt: skip


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(args: argparse.Namespace) -> int:
    """Load the checkpoint and serve it until interrupted."""
    try:
        import uvicorn

        from vagent.serve.app import ServerOptions, create_app
    except ImportError as e:
        raise SystemExit(f"vagent serve needs the serve extra: pip install 'vagent[serve]' ({e})") from None
    from vagent.model import load_policy
    from vagent.toolbox import TOOLS

    tools = [t for t in args.tools.split(",") if t]
    from vagent.agents import PROFILES

    if args.agent_profile not in PROFILES:
        raise SystemExit(
            f"vagent serve: error: unknown --agent-profile {args.agent_profile!r}; known: {sorted(PROFILES)}"
        )
    if unknown := sorted(set(tools) - set(TOOLS)):
        raise SystemExit(f"vagent serve: error: unknown tools {unknown}; available: {sorted(TOOLS)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.tensor_parallel_size > 1 and args.backend != "vllm":
        raise SystemExit("vagent serve: error: --tensor-parallel-size shards vLLM's engine: add --backend vllm")
    from vagent.rollout.vllm_backend import policy_placement

    engine_device, placement = policy_placement(args.backend, args.device, args.dtype, args.attn)
    policy = load_policy(args.model, **placement)  # with vLLM on a GPU: on the CPU (the engine holds the weights)
    positions = policy.model.config.get_text_config().max_position_embeddings
    own = PROFILES[args.agent_profile].limits  # the agent's own limits, unless given
    options = ServerOptions(
        model_name=args.served_model_name or Path(args.model).resolve().name,
        allowed_media_roots=[root.resolve() for root in args.allowed_media_root],
        max_queue=args.max_queue,
        max_image_pixels=args.max_image_pixels,
        max_model_len=args.max_model_len or positions,
        default_max_tokens=args.default_max_tokens,
        agent=args.agent,
        agent_profile=args.agent_profile,
        tools=tools,
        max_turns=args.max_turns or own.max_turns,
        max_images=args.max_images or own.max_images,
        tool_workers=args.tool_workers,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = None
    if args.backend == "vllm":
        from vagent.rollout.vllm_backend import VLLMBackend

        try:
            engine = VLLMBackend.for_policy(policy, device=engine_device, max_model_len=options.max_model_len,
                                            max_num_seqs=args.max_queue, max_images=options.max_images,
                                            gpu_memory_utilization=args.gpu_memory_utilization, sleep=False,
                                            tensor_parallel_size=args.tensor_parallel_size, tp_ranks=False)  # fmt: skip
        except ValueError as e:
            raise SystemExit(f"vagent serve: error: --backend vllm: {e}") from None
    app = create_app(policy, options, engine)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        if engine is not None:
            engine.close()
    return 0
