"""The generation backend under the engine: slot KV storage, stop strings on token ids, one-turn generate,
the turn-barrier reference."""

import dataclasses
import random

import pytest
import torch
from PIL import Image

from vagent.rollout import GenerationBackend, HFBackend, RolloutLimits, Task, TurnBarrier, generate, run
from vagent.rollout.decode_graphs import DecodeGraphs
from vagent.rollout.kv_cache import SlotCache
from vagent.rollout.stops import StopMatcher
from vagent.types import ContentPart, Message

IMAGE = Image.new("RGB", (320, 240), (30, 140, 200))
STOPS = ("</tool_call>", "</answer>")


def _prompt(text="What color is this?"):
    return [Message("user", [ContentPart("image", image=IMAGE), ContentPart("text", text)])]


def test_hf_backend_is_a_generation_backend(policy):
    assert isinstance(HFBackend(policy), GenerationBackend)
    assert isinstance(TurnBarrier(HFBackend(policy)), GenerationBackend)


def test_generate_respects_budget_and_never_samples_vision_tokens(policy):
    greedy = generate(policy, _prompt(), max_new_tokens=12)[0]
    assert 1 <= len(greedy.token_ids) <= 12 and len(greedy.logprobs) == len(greedy.token_ids)
    assert all(lp <= 0 for lp in greedy.logprobs)
    assert generate(policy, _prompt(), max_new_tokens=12)[0].token_ids == greedy.token_ids  # greedy is deterministic
    torch.manual_seed(0)
    backend = HFBackend(policy)
    samples = generate(policy, _prompt(), max_new_tokens=40, temperature=1.0, stop_strings=STOPS, n=4, backend=backend)
    placeholders = set(policy.vision_placeholder_ids)
    assert all(not placeholders & set(s.token_ids) for s in samples), "vision placeholders must never be sampled"
    assert backend.stats().prefill_tokens == samples[0].prompt_tokens  # 4 samples, one prefill
    for sample in samples:
        if sample.stop == "stop_string":
            assert any(sample.text.endswith(s) for s in STOPS)
        else:
            assert not any(s in sample.text for s in STOPS)


def test_generate_stops_at_a_stop_string_the_model_writes(policy):
    """A hook on the head makes the greedy turn write 'ab</answer>cd' token by token: it ends at the stop."""
    tok = policy.tokenizer
    forced = tok.encode("ab</answer>cd", add_special_tokens=False)
    step = iter(forced)

    def force(_module, _inputs, output):
        out = torch.full_like(output, -1e4)
        out[..., next(step)] = 0
        return out

    handle = policy.model.lm_head.register_forward_hook(force)
    try:
        out = generate(policy, _prompt(), max_new_tokens=20, stop_strings=STOPS)[0]
    finally:
        handle.remove()
    # the turn ends with the token that completes the stop (here one that runs past it, '>c'), not later
    end = next(i for i in range(len(forced)) if "</answer>" in tok.decode(forced[: i + 1])) + 1
    assert out.stop == "stop_string" and out.token_ids == forced[:end] and end < len(forced)


def _naive_stop(tok, tokens, stops):
    return any(s in tok.decode(tokens[-24:]) for s in stops)


def test_stop_matcher_agrees_with_decoding_the_tail_every_step(policy):
    """On random token streams built from pieces of the stop strings, the id matcher stops exactly where the
    old check (decode the last 24 tokens every step) first fires, and decodes far less."""
    tok = policy.tokenizer
    vocab = ["</", "tool", "_call", ">", "answer", "</answer>", "</tool_call>", " the", "x", ">\n", "{", '"', "a"]
    pieces = [ids for text in vocab for ids in [tok.encode(text, add_special_tokens=False)] if ids]
    rng = random.Random(0)
    matcher = StopMatcher(tok, STOPS)
    steps = fired = 0
    for _ in range(300):
        tokens: list[int] = []
        for _ in range(12):
            for token in rng.choice(pieces):
                tokens.append(token)
                steps += 1
                expected = _naive_stop(tok, tokens, STOPS)
                assert matcher.matches(tokens) == expected, tok.decode(tokens)
                if expected:
                    break
            else:
                continue
            fired += 1
            break
    assert fired > 50  # the streams did hit the stops, by several spellings
    assert matcher.decodes < steps / 2


def test_stop_matcher_fast_path_decodes_nothing(policy):
    tok = policy.tokenizer
    matcher = StopMatcher(tok, STOPS)
    ids = tok.encode('<tool_call>{"name": "crop"}</tool_call>', add_special_tokens=False)
    assert [matcher.matches(ids[: i + 1]) for i in range(len(ids))] == [False] * (len(ids) - 1) + [True]
    assert matcher.decodes == 0  # '</tool_call>' is its own token: matched on ids alone
    assert not StopMatcher(tok, ()).matches(ids)


def test_slot_cache_writes_in_place_and_reads_a_view_or_one_gather():
    cache = SlotCache(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.reserve(4, 8)
    storage = cache.keys[0].data_ptr()
    keys = torch.randn(2, 2, 3, 4)
    cache.plan([1, 2], [0, 2], 3, 5)  # consecutive slots: the returned keys are a view of the storage
    k, v = cache.update(keys, keys + 1, layer_idx=0)
    assert v.data_ptr() == cache.values[0][1].data_ptr()
    assert k.shape == (2, 2, 5, 4) and k.data_ptr() == cache.keys[0][1].data_ptr()
    torch.testing.assert_close(cache.keys[0][1, :, :3], keys[0])
    torch.testing.assert_close(cache.keys[0][2, :, 2:5], keys[1])
    torch.testing.assert_close(cache.values[0][2, :, 2:5], keys[1] + 1)
    cache.plan([3, 1], [0, 3], 1, 4)  # not consecutive: one gather, in the batch's order
    new = torch.randn(2, 2, 1, 4)
    k, _ = cache.update(new, new, layer_idx=1)
    torch.testing.assert_close(k[0, :, 0], new[0, :, 0])
    torch.testing.assert_close(k[1, :, 3], new[1, :, 0])
    cache.copy_slot(2, 0, 5)
    torch.testing.assert_close(cache.keys[0][0, :, :5], cache.keys[0][2, :, :5])
    assert cache.keys[0].data_ptr() == storage and cache.growths == 1
    cache.reserve(4, 200)  # room was allocated in steps of 256 tokens: no growth
    assert cache.capacity == 256 and cache.growths == 1
    cache.reserve(5, 300)  # growth (at least doubling) keeps what is stored
    torch.testing.assert_close(cache.keys[0][2, :, 2:5], keys[1])
    assert (cache.slots, cache.capacity, cache.growths) == (5, 512, 2)
    with pytest.raises(ValueError, match="reserve"):
        cache.plan([5], [0], 1, 1)


def _tasks():
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [10, 20, 120, 90]}}</tool_call>'
    return [
        Task(id="a", question="Where?", images=[IMAGE], scripted_turns=[None, crop, None]),
        Task(id="b", question="What?", images=[IMAGE], scripted_turns=[crop]),
        Task(id="c", question="Tell me.", images=[IMAGE]),
        Task(id="d", question="And?", images=[IMAGE], scripted_turns=[None, None, crop]),
    ]


def test_prefill_patch_blocks_are_stacked_on_the_device_as_one_concatenation_would():
    """The new images' patch blocks of a prefill go to the device block by block into one tensor (no host-side
    concatenation first): the same values as torch.cat, and a lone block is passed as it is."""
    from vagent.rollout.hf_backend import _stacked_on

    blocks = [torch.randn(n, 12) for n in (4, 16, 8)]
    stacked = _stacked_on(blocks, torch.device("cpu"))
    assert torch.equal(stacked, torch.cat(blocks)) and stacked.dtype == blocks[0].dtype
    assert _stacked_on(blocks[:1], torch.device("cpu")) is blocks[0]


def test_rows_keep_their_slots_and_the_storage_is_not_copied_when_rows_join_and_leave(policy):
    """Rows join and leave the decode batch at every turn and tool call: with room reserved, the storage is
    the same tensor from the first step to the last, and each row stays in one slot for its episode."""
    backend = HFBackend(policy)
    backend.cache.reserve(4, 4096)
    storage = [t.data_ptr() for t in backend.cache.keys]
    slots: dict[object, set[int]] = {}
    step = backend.step

    def watch():
        out = step()
        for key, row in backend._rows.items():
            slots.setdefault(key, set()).add(row.slot)
        return out

    backend.step = watch
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    out = run(policy, _tasks(), limits=limits, batch_size=4, backend=backend)
    assert [t.token_ids for t in out] == [t.token_ids for t in run(policy, _tasks(), limits=limits, batch_size=1)]
    assert [t.data_ptr() for t in backend.cache.keys] == storage and backend.stats().cache_growths == 1
    assert all(len(s) == 1 for s in slots.values()) and len(slots) == 4
    assert backend._rows == {} and sorted(backend._free) == [0, 1, 2, 3]  # every slot back on the free list
    stats = backend.stats()
    assert stats.decode_steps > 0 and stats.decode_tokens >= stats.decode_steps


def test_the_turn_barrier_reference_generates_the_same_tokens(policy):
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    barrier = TurnBarrier(HFBackend(policy))
    synced = run(policy, _tasks(), limits=limits, batch_size=4, backend=barrier)
    assert [t.token_ids for t in synced] == [t.token_ids for t in run(policy, _tasks(), limits=limits, batch_size=4)]
    assert barrier.stats().forward_passes > 0


def test_a_turn_request_must_extend_its_row(policy):
    from vagent.rollout import Sampling, TurnRequest

    backend = HFBackend(policy)
    ids = policy.tokenizer.encode("hello there, a plain text prompt")
    backend.submit(TurnRequest("r", ids, [], [], Sampling(max_new_tokens=2, temperature=0.0)))
    while backend.busy:
        backend.step()
    backend.submit(TurnRequest("r", ids[:3], [], [], Sampling(max_new_tokens=2)))
    with pytest.raises(ValueError, match="must extend"):
        backend.step()
    with pytest.raises(ValueError, match="max_new_tokens"):
        backend.submit(TurnRequest("s", ids, [], [], Sampling(max_new_tokens=0)))
    backend.release("r")
    assert not backend.busy and backend._free == [0]


def test_under_autocast_the_cache_stores_what_the_layers_make(policy):
    """The GRPO recipe rolls out under bf16 autocast: keys are stored in bf16, and the rollout still runs."""
    backend = HFBackend(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(policy, _tasks()[:2], limits=RolloutLimits(max_turns=2, max_new_tokens=6), backend=backend)
    assert backend.cache.dtype == torch.bfloat16 and all(t.metrics["sampled_tokens"] > 0 for t in out)
    assert all(len(t.token_ids) == len(t.logprobs) == len(t.loss_mask) for t in out)


def _grow_every(backend: HFBackend, steps: int) -> None:
    """Reallocate the backend's KV storage (one slot more) every ``steps`` steps: graphs must be dropped and
    captured again for the new addresses."""
    step, count = backend.step, [0]

    def growing():
        count[0] += 1
        if count[0] % steps == 0:
            backend.cache.reserve(backend.cache.slots + 1, backend.cache.capacity)
        return step()

    backend.step = growing


def test_bucketed_decode_steps_generate_the_eager_steps_tokens(policy):
    """What a CUDA graph records, run eagerly: each decode step padded to a power-of-two batch (the padding rows
    write into a scratch slot) and a power-of-two key length gives the unpadded step's greedy tokens, through
    rows joining and leaving and the storage moving, one graph per shape."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    tasks = _tasks()[:3]  # three rows: the batch pads to four
    backend = HFBackend(policy, cuda_graphs=False)
    backend.graphs = DecodeGraphs(policy.model, backend.cache, backend._cache_argument, capture=False)
    seen = []
    decode = backend.graphs.decode
    backend.graphs.decode = lambda ids, *args, **kwargs: seen.append(len(ids)) or decode(ids, *args, **kwargs)
    bucketed = run(policy, tasks, limits=limits, batch_size=3, backend=backend)
    plain = HFBackend(policy, cuda_graphs=False)
    eager = run(policy, tasks, limits=limits, batch_size=3, backend=plain)
    assert [t.token_ids for t in bucketed] == [t.token_ids for t in eager]
    assert 3 in seen and len(seen) == backend.stats().decode_steps  # every decode step went through the buckets
    assert {batch for batch, _, _ in backend.graphs.graphs} <= {1, 2, 4} and len(backend.graphs.graphs) <= 6
    assert all(keys >= 128 and keys & (keys - 1) == 0 for _, keys, _ in backend.graphs.graphs)
    # the scratch slot is reserved with the rows' and the key buckets fit the storage: no extra reallocation
    assert backend.stats().cache_growths == plain.stats().cache_growths
    assert backend.stats().graph_captures == 0  # nothing captured on the CPU
    assert HFBackend(policy).graphs is None  # graphs are a CUDA thing
    moving = HFBackend(policy, cuda_graphs=False)
    moving.graphs = DecodeGraphs(policy.model, moving.cache, moving._cache_argument, capture=False)
    _grow_every(moving, 3)
    assert [t.token_ids for t in run(policy, tasks, limits=limits, batch_size=3, backend=moving)] \
        == [t.token_ids for t in eager]  # fmt: skip
    assert moving.stats().cache_growths > plain.stats().cache_growths + 3


@pytest.mark.gpu
def test_cuda_graph_decode_generates_the_eager_tokens(tiny_qwen25):
    """Replayed graphs give the eager steps' greedy tokens (fp32): padded batches, the storage reallocated under
    them (graphs dropped and captured again into a new pool), and under bf16 autocast, the GRPO recipe's."""
    from vagent.model import load_policy

    policy = load_policy(tiny_qwen25, device="cuda", dtype="float32")
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    tasks = _tasks()[:3]
    eager = run(policy, tasks, limits=limits, batch_size=3, backend=HFBackend(policy, cuda_graphs=False))
    graphed = HFBackend(policy)
    _grow_every(graphed, 3)
    out = run(policy, tasks, limits=limits, batch_size=3, backend=graphed)
    assert graphed.graphs.failed is None and graphed.stats().graph_captures > 3
    assert [t.token_ids for t in out] == [t.token_ids for t in eager]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the captures left no stream current
    autocast = HFBackend(policy)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast = run(policy, tasks, limits=limits, batch_size=3, backend=autocast)
    assert autocast.graphs.failed is None and autocast.stats().graph_captures > 0
    assert autocast.cache.dtype == torch.bfloat16 and all(t.metrics["sampled_tokens"] > 0 for t in cast)


def test_the_inverse_cdf_draw_has_the_multinomial_distribution_and_never_draws_a_zero():
    from vagent.rollout.hf_backend import _draw

    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1, 12) * 2, -1)
    probs[0, [0, 5, 11]] = 0  # suppressed tokens, the first and the last among them
    probs = probs / probs.sum()
    n = 100_000
    drawn = _draw(probs.expand(n, -1).contiguous())
    freq = torch.bincount(drawn, minlength=12).double() / n
    assert freq[[0, 5, 11]].sum() == 0
    assert torch.allclose(freq, probs[0].double(), atol=5 * (0.25 / n) ** 0.5)  # 5 sigma at worst
    # u at its extremes: 0 lands on the first token with mass, the largest u below 1 on the last one
    for u, expected in ((0.0, 1), (1 - 2**-53, 10)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "rand", lambda shape, u=u, **kw: torch.full(shape, u, **kw))
            assert _draw(probs).tolist() == [expected]


# -- the model as a user loads it: another attention kernel, LoRA adapters -------------------------------------------


@pytest.mark.parametrize("kernel", ["eager", "flash_attention_2"])
def test_generation_runs_sdpa_over_the_slot_mask_whatever_kernel_the_model_was_loaded_with(tiny_qwen25, kernel):
    """The slot mask is 4-D boolean: eager attention would add it to the scores and flash-attention read it as a
    padding mask. The backend runs SDPA for its forwards (flash_attention_2 is set on the config here as the gpu
    extra's `auto` would; its kernel is never reached) and leaves the model's own setting as it was."""
    from vagent.model import load_policy

    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    reference = run(load_policy(tiny_qwen25, device="cpu", attn_implementation="sdpa"), _tasks(), limits=limits,
                    batch_size=4)  # fmt: skip
    other = load_policy(tiny_qwen25, device="cpu", attn_implementation="eager")
    if kernel != "eager":  # on the language model: the vision tower keeps its own kernel (flash-attn needs a GPU)
        other.model.config.get_text_config()._attn_implementation = kernel
    out = run(other, _tasks(), limits=limits, batch_size=4)
    assert [t.token_ids for t in out] == [t.token_ids for t in reference]
    assert other.model.config.get_text_config()._attn_implementation == kernel


def test_a_lora_wrapped_policy_generates_through_its_adapters(tiny_qwen25):
    """Under peft, `policy.model.model` is the whole ForConditionalGeneration (logits, no hidden states): the
    backend reaches the decoder through one unwrap that knows peft. Fresh adapters (B = 0) generate the base
    model's tokens; adapters that moved change them."""
    from vagent.model import load_policy
    from vagent.training.adapters import apply_lora

    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    base = run(load_policy(tiny_qwen25, device="cpu"), _tasks(), limits=limits, batch_size=4)
    policy = load_policy(tiny_qwen25, device="cpu")
    policy.model = apply_lora(policy.model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    fresh = run(policy, _tasks(), limits=limits, batch_size=4)
    assert [t.token_ids for t in fresh] == [t.token_ids for t in base]
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0)
    moved = run(policy, _tasks(), limits=limits, batch_size=4)
    assert [t.token_ids for t in moved] != [t.token_ids for t in base]


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.3, 0.8)])
def test_a_sampled_token_records_the_log_prob_of_the_distribution_it_was_drawn_from(policy, temperature, top_p):
    """softmax(z / T) without the vision placeholders, cut to the nucleus and renormalized: what GRPO's trainer scores
    at the same T and top_p, so the ratio compares the distributions the tokens really came from (before, T = 1
    log-probs were recorded)."""
    from vagent.data import encode_messages
    from vagent.data.batching import collate
    from vagent.model import masked_token_logprobs, policy_logits

    torch.manual_seed(0)
    limits = RolloutLimits(max_turns=1, max_new_tokens=12, temperature=temperature, top_p=top_p)
    out = run(policy, _tasks()[2:3], 3, limits, batch_size=3)
    min_pixels, max_pixels = policy.pixel_budget
    for t in out:
        enc = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
        batch = collate([enc], policy.tokenizer.pad_token_id or 0)
        sampled = enc.loss_mask.bool()  # 1 = sampled
        with torch.no_grad():
            z = policy_logits(policy.model, batch)[0, :-1]  # (T-1, V): position t predicts t + 1
            z[:, policy.vision_placeholder_ids] = float("-inf")  # never drawn: out of the distribution first
            z = z / temperature
            probs = torch.softmax(z, dim=-1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # mass before the token reaches top_p
            cut = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, outside)
            expected = torch.log_softmax(z.masked_fill(cut, float("-inf")), dim=-1)
            expected = expected.gather(-1, enc.input_ids[1:, None]).squeeze(1)
            trainer, _ = masked_token_logprobs(policy.model, batch, enc.loss_mask[None], temperature=temperature,
                                               top_p=top_p, suppress=tuple(policy.vision_placeholder_ids))  # fmt: skip
        recorded = torch.tensor(t.logprobs)
        assert torch.allclose(recorded[sampled], expected[sampled[1:]], atol=1e-4)
        assert torch.allclose(trainer[0][sampled], recorded[sampled], atol=1e-4)


def test_a_kv_budget_sizes_the_storage_once_and_rows_that_do_not_fit_wait(policy):
    """A budget of two rows of max_total_tokens: four episodes run two at a time in storage allocated once (no
    growth, whatever the turns ask), with the tokens of unbudgeted storage; a budget below one row is refused."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, max_total_tokens=1024, temperature=0.0)
    plain = run(policy, _tasks(), limits=limits, batch_size=4)
    per_row = HFBackend(policy).cache.token_bytes(policy.dtype) * (limits.max_total_tokens + 1)
    backend = HFBackend(policy, kv_cache_bytes=2 * per_row + per_row // 2, row_tokens=limits.max_total_tokens)
    assert backend.max_rows == 2
    in_flight = []
    step = backend.step

    def watch():
        in_flight.append(len(backend._rows))
        return step()

    backend.step = watch
    for _ in range(2):  # kept across calls, as GRPO keeps it across refill rounds and steps
        out = run(policy, _tasks(), limits=limits, batch_size=4, backend=backend)
        assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert max(in_flight) == 2 and backend.cache.slots == 2 and backend.stats().cache_growths == 1
    capped = HFBackend(policy, kv_cache_bytes=100 * per_row, row_tokens=limits.max_total_tokens, row_limit=3)
    assert capped.max_rows == 3  # a budget larger than the rows in flight need allocates only what they need
    tight = HFBackend(policy, kv_cache_bytes=per_row // 2, row_tokens=limits.max_total_tokens)
    with pytest.raises(ValueError, match="holds no row"):  # said when the storage is made, in the dtype it runs in
        run(policy, _tasks(), limits=limits, batch_size=4, backend=tight)
    assert not tight._rows  # the rows were released


def test_under_a_kv_budget_decode_buckets_stop_at_the_rows_it_holds(policy):
    """Three rows fit the budget (and the graphs' scratch slot): three decode rows run as a batch of three, not
    padded to the next power of two, with the unbucketed tokens."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, max_total_tokens=1024, temperature=0.0)
    plain = run(policy, _tasks(), limits=limits, batch_size=4)
    per_row = HFBackend(policy).cache.token_bytes(policy.dtype) * (limits.max_total_tokens + 1)
    backend = HFBackend(policy, kv_cache_bytes=4 * per_row + per_row // 2, row_tokens=limits.max_total_tokens)
    backend.graphs = DecodeGraphs(policy.model, backend.cache, backend._cache_argument, capture=False, max_batch=64)
    assert backend.max_rows == 3
    out = run(policy, _tasks(), limits=limits, batch_size=4, backend=backend)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert 3 in {batch for batch, _, _ in backend.graphs.graphs} <= {1, 2, 3}


def test_storage_grown_on_demand_is_freed_between_rollouts_and_grows_again(policy):
    """GRPO frees the KV storage a rollout grew before its update; the next rollout grows it again, same tokens."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    backend = HFBackend(policy)
    first = run(policy, _tasks(), limits=limits, batch_size=4, backend=backend)
    assert backend.cache.slots > 0
    backend.free_storage()
    assert backend.cache.slots == 0 and backend.cache.capacity == 0
    again = run(policy, _tasks(), limits=limits, batch_size=4, backend=backend)
    assert [t.token_ids for t in again] == [t.token_ids for t in first]


def test_a_seeded_sample_draws_the_same_tokens_whatever_shares_its_batch_or_chunk(policy):
    # vagent eval's reruns: each turn's seed is made of the task id, the sample index and the turn, and the HF
    # backend draws a seeded turn from its own generator, so a task run alone, in another batch or after other
    # chunks samples the same tokens (greedy would show nothing: sample at T = 1)
    limits = RolloutLimits(max_turns=3, max_new_tokens=12, temperature=1.0, sampling_seed=7)
    together = run(policy, _tasks(), 2, limits=limits, batch_size=8)
    torch.manual_seed(123)  # the shared stream moves; the seeded turns must not care
    alone = [t for task in reversed(_tasks()) for t in run(policy, [task], 2, limits=limits, batch_size=1)]
    by_sample = {(t.task_id, i % 2): t.token_ids for i, t in enumerate(together)}
    assert {(t.task_id, i % 2): t.token_ids for i, t in enumerate(alone)} == by_sample
    assert by_sample[("c", 0)] != by_sample[("c", 1)]  # the samples of a task are different draws
    other = run(policy, _tasks(), 2, limits=dataclasses.replace(limits, sampling_seed=8), batch_size=8)
    assert [t.token_ids for t in other] != [t.token_ids for t in together]
