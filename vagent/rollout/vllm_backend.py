"""Generation on vLLM, colocated with the trainer: the ``GenerationBackend`` users run at scale.

One engine per rank, in the rank's own process (vLLM's in-process engine core; under torchrun its
``external_launcher`` executor, as TRL's ``vllm_mode="colocate"`` runs it), tensor parallel 1 by default; with
``tensor_parallel_size`` the engines of consecutive ranks each hold a shard of the model and step on one request
stream that the group agrees on before every step (``vagent.rollout.vllm_group``); a server or a one-process
evaluation shards it over vLLM's own worker processes instead (``tp_ranks``). The engine, the
toolbox, the agent profiles and the encoder are the rollout's own: this backend only turns a turn request into an
engine request and the engine's output back into sampled ids and log-probs.

What it guarantees, and why:

* **Token-in, token-out.** The request's ids are the encoder's, with each image's run of ``<|image_pad|>`` collapsed
  to one pad (vLLM expands each pad itself, from the image it is sent: ids already expanded would be expanded
  again, silently: TRL#6294; verl collapses them in ``qwen2_5_vl_dedup_image_tokens``). The images sent are the
  model-sized images the engine's patches were made from (``ImagePatches.image``), which vLLM's processor leaves at
  their size; the engine's expanded prompt is checked against the encoder's length at every turn.
* **The log-probs of the distribution sampled from.** ``logprobs_mode="processed_logprobs"``: after the banned
  tokens, the temperature and the nucleus, what GRPO's trainer scores at the same temperature and top_p.
* **Vision placeholders are never sampled** (a sampled ``<|image_pad|>`` breaks the next forward's RoPE index:
  R1-V#91, verl#3469): an engine-wide logits processor sets their logits to -inf before the temperature, as the
  HF backend does (vLLM's per-request ``bad_words`` would tokenize them again for every turn and mask them row by
  row at every step).
* **The trained weights.** ``load_weights`` streams ``(name, tensor)`` pairs, HF names, into vLLM's layerwise
  ``reload_weights`` (plain ``load_weights`` fails on a CPU, whose linear weights are repacked), then resets the
  prefix cache (else cached KV of the old weights is reused, silently) and the encoder cache.
* **Nothing hangs for ever.** With ``watchdog_s`` a step that does not return in time dumps every thread's stack and
  the engine's queue to stderr and ends the process (``faulthandler``): a hung engine would otherwise hold every
  rank until the collective timeout.

Not covered here: vLLM's own LoRA (adapters are merged and pushed as weights),
and, on GPUs, what no CPU can test (sleep mode, CUDA graphs): ``docs/guide/rollout.md`` says what is tested where.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from vagent.rollout.backend import BackendStats, TurnRequest, TurnResult
from vagent.rollout.vllm_engine import Watchdog, engine_device, start_engine
from vagent.rollout.vllm_group import RefusedRequest, TPGroup

__all__ = ["VLLMBackend", "collapse_image_pads", "engine_device", "policy_placement", "vllm_unsupported"]

# head sizes vLLM's CPU attention backend takes (cpu_attn: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def collapse_image_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """The ids with each run of ``pad_id`` collapsed to one: the form vLLM expands from the images it is sent.

    >>> collapse_image_pads([1, 9, 9, 9, 2, 9, 3], 9)
    [1, 9, 2, 9, 3]
    """
    out: list[int] = []
    for token in ids:
        if token == pad_id and out and out[-1] == pad_id:
            continue
        out.append(token)
    return out


def policy_placement(backend: str, device: str | None, dtype: str | None,
                     attn: str | None = None) -> tuple[str | None, dict[str, Any]]:  # fmt: skip
    """``(engine device, load_policy keyword arguments)`` of a command whose ``backend`` (``hf``/``vllm``) generates
    on ``device`` (None: CUDA when available), the policy asked for in ``dtype`` and ``attn``. With vLLM on a GPU the
    engine holds the weights (sharded, with tensor parallelism), so the HF policy (its processor, config and
    tokenizer; it runs no forward) stays on the CPU with sdpa, loaded in the dtype the engine is to run in (``auto``
    as on CUDA: ``VLLMBackend.for_policy`` takes the policy's). Otherwise the policy is loaded as asked (the engine
    device is None for ``hf``: the HF backend runs on the policy)."""
    from vagent.model import resolve_dtype

    asked = {"device": device, "dtype": dtype, "attn_implementation": attn}
    if backend != "vllm":
        return None, asked
    kind = engine_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if kind == "cpu":
        return kind, {**asked, "device": device or "cpu"}
    return kind, {"device": "cpu", "dtype": resolve_dtype(dtype, torch.device(kind)), "attn_implementation": "sdpa"}


def vllm_unsupported(config: Any, device: str) -> str | None:
    """Why vLLM cannot run a checkpoint of this HF ``config`` on ``device`` (None: it can)."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (
            f"vLLM's CPU attention takes head sizes {list(CPU_HEAD_SIZES)}, and this checkpoint's is {head_dim}: "
            "build it with `vagent make-tiny-model --size small` (head_dim 32) or larger, or generate with vagent's HF "
            "backend (rollout.backend=hf, --backend hf)"
        )
    return None


class VLLMBackend:
    """A colocated vLLM engine behind the ``GenerationBackend`` Protocol (see the module docstring).

    Args:
        model_path: The checkpoint dir the engine loads (the trainer's starting weights; ``load_weights`` pushes
            the trained ones).
        dtype: The engine's weights' dtype (the trainer's compute dtype).
        eos_token_ids: Tokens that end a turn (``Policy.eos_token_ids``).
        image_pad_id: The image placeholder (``config.image_token_id``).
        max_model_len: The longest row (``rollout.max_total_tokens``).
        max_num_seqs: Sequences the engine schedules at once.
        max_images: Images per row (``rollout.max_images``).
        seed: The engine's sampling seed (make it differ per rank; per TP group, the same on its ranks).
        gpu_memory_utilization: On a GPU, the engine's share of the device memory.
        kv_cache_gb: The KV cache's size in GiB (on a CPU, ``VLLM_CPU_KVCACHE_SPACE``, default 1 GiB there: per worker
            process when the shards run in vLLM's own, ``tp_ranks`` False).
        sleep: On a GPU, let ``sleep``/``wake_up`` free and restore the engine's memory around the update.
        watchdog_s: Seconds a step may take before the process is ended with every stack in the log (0 = off).
        device: ``"cpu"`` or ``"cuda"``.
        pixels: ``(min_pixels, max_pixels)`` of the engine's image processor (``Policy.pixel_budget``, which
            ``vagent eval --max-pixels`` may change); None = the checkpoint's. The images come model-sized: the
            engine must leave them so.
        tensor_parallel_size: Shards of the model (one per device): see ``tp_ranks``.
        tp_ranks: Where the shards run when ``tensor_parallel_size`` > 1. True: in the engines of consecutive
            torchrun ranks, one shard each (every rank makes its backend at the same point; ``max_num_seqs`` is then
            the group's; each rank still submits and gets back only its own rows, and after its rollout calls
            ``settle``); what a trainer needs, whose weight sync reaches every shard in its own rank. False: in vLLM's
            own worker processes, one per shard, this process's engine driving them (``vagent serve``, the demo, a
            one-process ``vagent eval``; no weight sync). None: True under torch.distributed, else False.

    The checkpoint's vision placeholders are never sampled (``vagent.vllm_logits``).
    """

    # vLLM's processor makes the patches from the images sent: the rollout engine makes none for it (only the grids
    # its ids need), unless a trainer takes them (GRPO's keep_patches)
    needs_pixels = False

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype,
        eos_token_ids: Sequence[int],
        image_pad_id: int,
        max_model_len: int,
        max_num_seqs: int,
        max_images: int,
        seed: int = 0,
        gpu_memory_utilization: float = 0.4,
        kv_cache_gb: float | None = None,
        sleep: bool = True,
        watchdog_s: float = 0.0,
        device: str = "cpu",
        pixels: tuple[int, int] | None = None,
        tensor_parallel_size: int = 1,
        tp_ranks: bool | None = None,
    ) -> None:
        if tp_ranks is None:
            tp_ranks = torch.distributed.is_available() and torch.distributed.is_initialized()
        sharded_here = tensor_parallel_size > 1 and tp_ranks
        self._group = TPGroup(tensor_parallel_size, seed, device) if sharded_here else None
        self._workers = tensor_parallel_size if tensor_parallel_size > 1 and not tp_ranks else 0
        try:
            self.llm = start_engine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                     max_num_seqs=max_num_seqs, max_images=max_images,
                                     gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb,
                                     sleep=sleep and not self._workers, device=device, pixels=pixels,
                                     tensor_parallel_size=tensor_parallel_size, tp_ranks=tp_ranks)  # fmt: skip
        except Exception as e:  # vLLM reports a worker's failure as a bare Exception: its cause is in their log
            if not self._workers or type(e) is not Exception:
                raise
            raise ValueError(f"vLLM's {self._workers} worker processes did not start ({type(e).__name__}: {e}); "
                             "their own error is in the log above") from e  # fmt: skip
        self._engine = self.llm.llm_engine
        self.dtype = dtype
        self.device = device
        self.sleeping = False
        self._sleep = sleep and device != "cpu" and not self._workers  # only a weight sync wakes it: none there
        self._eos = list(eos_token_ids)
        self._pad = image_pad_id
        self._watchdog = Watchdog(watchdog_s, lambda: sorted(str(key) for key in self._live))
        self._requests: dict[str, tuple[Hashable, list[int]]] = {}  # request id -> (row key, the encoder's ids)
        self._live: dict[Hashable, str] = {}  # row key -> its running request
        self._partial: dict[Hashable, Sequence[int]] = {}  # row key -> the tokens its running turn sampled so far
        self._count = 0
        self._stats = BackendStats()

    @classmethod
    def for_policy(cls, policy: Any, *, dtype: torch.dtype | None = None, device: str | None = None,
                   **kwargs: Any) -> VLLMBackend:  # fmt: skip
        """An engine over ``policy``'s checkpoint, with its tokens (EOS, image pad), on
        ``device`` (default: the policy's); ``dtype`` defaults to the policy's; ``kwargs`` as for the constructor.

        Raises:
            ValueError: vLLM cannot run this checkpoint here (``vllm_unsupported``: one line, with the remedy), or
                not on this GPU (``engine_device``).
        """
        device = engine_device(device or policy.device)
        why = vllm_unsupported(policy.model.config, device)
        if why:
            raise ValueError(why)
        return cls(
            policy.path, dtype=dtype or policy.dtype, eos_token_ids=policy.eos_token_ids,
            image_pad_id=policy.model.config.image_token_id, device=device, pixels=policy.pixel_budget, **kwargs,
        )  # fmt: skip

    # -- the GenerationBackend Protocol ---------------------------------------------------------------

    def submit(self, request: TurnRequest) -> None:
        from vllm.inputs import TokensPrompt

        if self.sleeping:  # level-2 sleep dropped the weights: only load_weights wakes the engine
            raise RuntimeError("the vLLM engine is asleep: give it the trained weights (load_weights) before sampling")
        if any(image is None for image in request.images) or len(request.images) != len(request.pixel_values):
            raise ValueError("the vLLM backend needs each image of a turn request (TurnRequest.images)")
        s = request.sampling
        sampling = {"temperature": s.temperature, "top_p": s.top_p if s.temperature > 0 else 1.0,
                    "max_tokens": s.max_new_tokens, "stop": list(s.stop_strings) or None, "seed": s.seed}  # fmt: skip
        prompt = TokensPrompt(prompt_token_ids=collapse_image_pads(request.ids, self._pad))
        if request.images:
            prompt["multi_modal_data"] = {"image": list(request.images)}
        self._count += 1
        if self._group is None:
            request_id = f"{self._count}"
            self._add(request_id, prompt, sampling)  # raises for a request vLLM refuses: nothing recorded
        else:  # added, on every rank of the group, at the group's next step
            request_id = f"{self._group.rank}.{self._count}"
            self._group.queue(("add", request_id, prompt, sampling))
        self._requests[request_id] = (request.key, request.ids)
        self._live[request.key] = request_id

    def _add(self, request_id: str, prompt: Any, sampling: dict[str, Any]) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            stop_token_ids=self._eos,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own
            skip_special_tokens=False,
            **sampling,
        )
        self._engine.add_request(request_id, prompt, params)

    def step(self) -> list[TurnResult]:
        start = time.perf_counter()
        with self._watchdog, self._no_autocast():
            if self._group is None:
                outputs = self._engine.step()
            else:  # the group's ops first, then a step of every rank's engine
                try:
                    outputs, _ = self._group.step(self._engine, self._add, self._requests, done=False)
                except RefusedRequest as e:  # nothing kept of it; raised as it would be without a group
                    key, _ = self._requests.pop(e.request_id)
                    self._live.pop(key, None)
                    raise e.cause from None
        self._stats.forward_s += time.perf_counter() - start
        self._stats.forward_passes += 1
        results = []
        for out in outputs:
            if out.request_id not in self._requests:  # another rank's row (TP group)
                continue
            if not out.finished:
                # by reference: copied only when a streaming caller asks (partial), not at every decode step
                self._partial[self._requests[out.request_id][0]] = out.outputs[0].token_ids
                continue
            key, ids = self._requests.pop(out.request_id)
            self._live.pop(key, None)
            self._partial.pop(key, None)
            if list(out.prompt_token_ids) != ids:  # the one-encoder contract: what vLLM ran is what will be trained
                raise RuntimeError(
                    f"vLLM expanded row {key!r}'s prompt to {len(out.prompt_token_ids)} tokens that are not the "
                    f"encoder's {len(ids)}: its processor saw other image sizes (a pixel budget other than the "
                    "checkpoint's?)"
                )
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)]
            self._stats.prefill_tokens += len(ids) - (out.num_cached_tokens or 0)
            self._stats.decode_tokens += len(tokens)
            stop = _stop(completion.finish_reason, completion.stop_reason)
            if stop is None:  # vLLM ended the request itself (an error, an abort): not a turn the policy finished
                raise RuntimeError(f"vLLM ended row {key!r}'s turn with finish reason {completion.finish_reason!r}")
            results.append(TurnResult(key, tokens, logprobs, stop))
        return results

    def release(self, key: Hashable) -> None:
        request_id = self._live.pop(key, None)
        self._partial.pop(key, None)
        if request_id is not None:  # only after an error: a finished turn's request is gone already
            self._requests.pop(request_id, None)
            if self._group is None:
                self._engine.abort_request([request_id])
            else:
                self._group.queue(("abort", request_id))

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks sharding this engine (1: a whole engine in this rank, or one sharded over vLLM's worker processes).
        Above 1 every rank of the group must call ``run`` as many times (a rank with nothing left rolls out no task)."""
        return self._group.size if self._group is not None else 1

    @property
    def busy(self) -> bool:
        # a TP group's ranks step together: each rank's loop steps at every turn of its loop until it settles
        return self._group is not None or self._engine.has_unfinished_requests()

    def settle(self) -> None:
        """After this rank's rollout, in a TP group: step with the group until every rank's rollout is over (the
        group's engines must step together). A no-op without a group."""
        if self._group is None:
            return
        all_done = False
        while not all_done:  # the watchdog times each step, not the wait for the slowest rank
            with self._watchdog, self._no_autocast():
                _, all_done = self._group.step(self._engine, self._add, self._requests, done=True)  # others' rows

    def stats(self) -> BackendStats:
        return self._stats

    def partial(self) -> dict[Hashable, list[int]]:
        """The tokens each running turn has sampled so far (for streaming)."""
        return {key: list(tokens) for key, tokens in self._partial.items()}

    def free_storage(self) -> None:
        """The rollout is over until the next weight sync: on a GPU the engine sleeps (``sleep``); a no-op on a CPU,
        where the engine's KV cache is sized once."""
        self.sleep()

    # -- weights and memory --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Put the trained weights into the engine (HF state-dict names, any dtype; a generator streams them one at a
        time) and drop every cache made with the old ones. Returns the seconds it took.

        Raises:
            RuntimeError: The engine did not take them (one line; the engine is not used again).
        """
        if self._workers:
            raise RuntimeError(
                f"this vLLM engine's {self._workers} shards run in vLLM's worker processes, which the trained weights "
                "cannot be streamed to: a trainer shards the engine over its torchrun ranks (tp_ranks=True)"
            )
        start = time.perf_counter()
        with self._watchdog, self._no_autocast():
            if self.sleeping:  # weights first, then the KV cache (TRL, verl): the trainer's freed blocks go back first
                self._empty_cache()
                self.llm.wake_up(tags=["weights"])
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            except Exception as e:
                raise RuntimeError(f"the vLLM engine did not take the trained weights: {type(e).__name__}: {e}") from e
            if self.sleeping:
                self._empty_cache()  # the streamed whole tensors' blocks
                self.llm.wake_up(tags=["kv_cache"])
                self.sleeping = False
            # a prefix cached under the old weights would be reused silently (reload_weights resets the encoder's)
            if not self.llm.reset_prefix_cache():
                raise RuntimeError(
                    "the vLLM engine kept its prefix cache (requests still running during a weight sync)"
                )
            self._engine.reset_encoder_cache()
        return time.perf_counter() - start

    def sleep(self) -> None:
        """On a GPU, free the engine's weights and KV cache for the update (level 2: the weights are lost, and only
        ``load_weights`` wakes the engine: a caller must sync while ``sleeping``, trained or not). A no-op on a CPU."""
        if self._sleep and not self.sleeping:
            with self._watchdog:
                self.llm.sleep(level=2)
            self.sleeping = True

    def _no_autocast(self) -> Any:
        """vLLM runs its own precision: the trainer's autocast (GRPO's rollout runs inside it) must not reach it."""
        return torch.autocast("cuda" if self.device != "cpu" else "cpu", enabled=False)

    def _empty_cache(self) -> None:
        if self.device != "cpu":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Shut the engine down and free what it holds."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        self._watchdog.stop()
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            self._engine = None
            gc.collect()


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> str | None:
    """The turn's stop (``TurnResult.stop``) from vLLM's finish reason; None for one the policy did not cause."""
    if finish_reason == "length":
        return "length"
    if finish_reason != "stop":
        return None
    return "stop_string" if isinstance(stop_reason, str) else "eos"
