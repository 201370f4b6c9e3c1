"""FlexAttention over the slot cache (``HFBackend(attention="flex")``): its block mask is the dense slot mask block by
block, its attention is SDPA's over the gathered slots, and the backend samples SDPA's greedy tokens with it."""

import pytest
import torch
from conftest import BOTH_VOCABS
from test_rollout_backend import _tasks

from vagent.rollout import HFBackend, RolloutLimits, Sampling, TurnRequest, run
from vagent.rollout import slot_attention as sa
from vagent.rollout.decode_graphs import DecodeGraphs, _bucket
from vagent.rollout.kv_cache import BLOCK, SlotCache, causal_mask

# rows of a forward over a 6-slot, 3-block-per-slot storage: (slot, cached tokens). The lengths sit on both sides of
# block boundaries (126, 127 | 128: a block is full for a query from cached 127 on), at 0 and near the end of a slot;
# slots are out of order and not consecutive.
ROWS = [(3, 0), (0, 127), (4, 128), (1, 255), (2, 40), (5, 126)]
SLOTS, CAPACITY = 6, 3 * BLOCK


def _expected(rows, width):
    """(B, width, SLOTS * CAPACITY) bool: the dense ``causal_mask`` in each row's slot of the flat storage."""
    dense = causal_mask([c for _, c in rows], [width] * len(rows), CAPACITY)[:, 0]  # (B, width, CAPACITY)
    out = torch.zeros(len(rows), width, SLOTS * CAPACITY, dtype=torch.bool)
    for b, (slot, _) in enumerate(rows):
        out[b, :, slot * CAPACITY : (slot + 1) * CAPACITY] = dense[b]
    return out


def _from_blocks(mask, width):
    """What the fused kernel computes with: full blocks whole, partial blocks through ``mask_mod``, nothing else.
    Also checks that each listed block is classified exactly (full: True throughout; partial: mixed)."""
    rows = mask.kv_num_blocks.shape[0]
    out = torch.zeros(rows, width, SLOTS * CAPACITY, dtype=torch.bool)
    lists = ((mask.full_kv_num_blocks, mask.full_kv_indices, True), (mask.kv_num_blocks, mask.kv_indices, False))
    for b in range(rows):
        for tile in range(mask.kv_num_blocks.shape[2]):
            queries = torch.arange(tile * BLOCK, min(width, (tile + 1) * BLOCK))
            for counts, indices, full in lists:
                for block in indices[b, 0, tile, : counts[b, 0, tile]].tolist():
                    keys = torch.arange(block * BLOCK, (block + 1) * BLOCK)
                    q, k = torch.meshgrid(queries, keys, indexing="ij")
                    seen = mask.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
                    # full: visible throughout; partial: mixed (a block seen whole would skip the mask as full)
                    assert bool(seen.all()) if full else bool(seen.any()) and not bool(seen.all()), (b, tile, block)
                    out[b, q, k] = True if full else seen
    return out


@pytest.mark.parametrize("width", [1, 5, 129])  # a decode step, a short turn, a turn over two query tiles
def test_the_block_mask_is_the_dense_slot_mask_block_by_block(width):
    rows = [(s, c) for s, c in ROWS if c + width <= CAPACITY]
    slot_index, cached = torch.tensor([s for s, _ in rows]), torch.tensor([c for _, c in rows])
    mask = sa.slot_block_mask(slot_index, cached, width, CAPACITY, SLOTS)
    expected = _expected(rows, width)
    assert mask.shape == (len(rows), 1, width, SLOTS * CAPACITY)
    assert torch.equal(_from_blocks(mask, width), expected)  # what the compiled kernel reads
    b, q, k = torch.meshgrid(torch.arange(len(rows)), torch.arange(width), torch.arange(SLOTS * CAPACITY),
                             indexing="ij")  # fmt: skip
    assert torch.equal(mask.mask_mod(b, torch.zeros_like(b), q, k), expected)  # what the unfused path evaluates
    # each row's tiles list only its own slot's blocks up to its length: the longest row costs the others nothing
    listed = mask.kv_num_blocks + mask.full_kv_num_blocks  # (B, 1, tiles)
    last_query = torch.arange(listed.shape[2]) * BLOCK + BLOCK - 1
    assert torch.equal(listed[:, 0], (cached[:, None] + last_query.clamp(max=width - 1)) // BLOCK + 1)
    with pytest.raises(ValueError, match="multiple of the flex block"):
        sa.slot_block_mask(slot_index, cached, 1, CAPACITY + 1, SLOTS)


def _filled_caches(kv_heads=2, head_dim=8, layers=1):
    """A flat and a slot-first cache holding the same random keys and values in every slot."""
    caches = [SlotCache(layers, kv_heads, head_dim, torch.float32, torch.device("cpu"), flat=flat)
              for flat in (True, False)]  # fmt: skip
    torch.manual_seed(0)
    stored = torch.randn(2, SLOTS, kv_heads, CAPACITY, head_dim)
    for cache in caches:
        cache.fix(SLOTS, CAPACITY, torch.float32)
        cache.keys[0].copy_(stored[0])
        cache.values[0].copy_(stored[1])
    return caches


def _attend_both(width, heads=8):
    """One layer's attention for ``ROWS``' new tokens through the flat cache and flex, and through the slot-first
    cache and SDPA over the gathered slots with the dense mask."""
    rows = [(s, c) for s, c in ROWS if c + width <= CAPACITY]
    slots, cached = [s for s, _ in rows], [c for _, c in rows]
    flat, gathered = _filled_caches()
    torch.manual_seed(1)
    query = torch.randn(len(rows), heads, width, 8)
    new = torch.randn(2, len(rows), 2, width, 8)  # this forward's keys and values, written into the slots first
    key_length = max(cached) + width
    outs = []
    for cache in (flat, gathered):
        cache.plan(slots, cached, width, key_length)
        key, value = cache.update(new[0], new[1], layer_idx=0)
        outs.append((cache, key, value))
    (_, fk, fv), (_, gk, gv) = outs
    assert fk.shape == (1, 2, SLOTS * CAPACITY, 8) and fk.data_ptr() == flat.keys[0].data_ptr()  # a view: no copy
    mask = sa.slot_block_mask(torch.tensor(slots), torch.tensor(cached), width, CAPACITY, SLOTS)
    got, _ = sa.slot_flex_attention(None, query, fk, fv, mask, scaling=0.3)
    dense = causal_mask(cached, [width] * len(rows), key_length)
    want = torch.nn.functional.scaled_dot_product_attention(query, gk, gv, attn_mask=dense, scale=0.3, enable_gqa=True)
    return got, want.transpose(1, 2)


@pytest.mark.parametrize("width", [1, 129])
def test_flex_over_the_flat_storage_is_sdpa_over_the_gathered_slots(width):
    got, want = _attend_both(width)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # two inductor compiles, about a minute on two cores
def test_the_compiled_kernel_reads_the_block_lists_as_the_dense_mask(monkeypatch):
    """Compiled, flex_attention visits only the listed blocks and skips the mask on full ones (unfused, it evaluates
    ``mask_mod`` everywhere): the block lists themselves must be right. Compiled here on the CPU, as on CUDA."""
    monkeypatch.setitem(sa.COMPILE, "cpu", True)
    for width in (1, 129):
        got, want = _attend_both(width)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert set(sa._compiled) == {sa._decode, sa._prefill}


def test_the_flat_layout_keeps_slot_first_views_through_growth_and_dtype():
    cache = SlotCache(layers=1, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), flat=True)
    cache.reserve(3, 100)
    assert cache.capacity % BLOCK == 0 and cache.keys[0].shape == (3, 2, cache.capacity, 4)
    keys = torch.randn(1, 2, 5, 4)
    cache.plan([2], [0], 5, 5)
    flat, _ = cache.update(keys, keys, layer_idx=0)
    torch.testing.assert_close(flat[0, :, 2 * cache.capacity : 2 * cache.capacity + 5], keys[0])
    cache.copy_slot(2, 0, 5)
    cache.reserve(4, 600)  # grows: slots and capacity, what is stored kept
    torch.testing.assert_close(cache.keys[0][0, :, :5], keys[0])
    cache.ensure_dtype(torch.bfloat16)
    assert cache.keys[0].transpose(0, 1).is_contiguous()  # still (kv_heads, slots, capacity, head_dim) underneath
    torch.testing.assert_close(cache.keys[0][2, :, :5].float(), keys[0], atol=1e-2, rtol=1e-2)
    cache.fix(2, 1000, torch.float32)
    assert cache.capacity == 1024 and cache.aligned(1000) == 1024


def _counting_kernel(monkeypatch):
    """Count the flex calls by query width: proof that the flex path ran, prefill and decode."""
    widths: list[int] = []
    kernel = sa._kernel

    def counted(device_type, decode):
        widths.append(1 if decode else 2)
        return kernel(device_type, decode)

    monkeypatch.setattr(sa, "_kernel", counted)
    return widths


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_flex_and_sdpa_backends_sample_the_same_greedy_tokens(policy, monkeypatch):
    """Four rows of different lengths, three resuming after crop observations (new images prefilled into their
    slots), joining and leaving the batch: the same greedy tokens with either kernel (CPU, fp32)."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    sdpa = run(policy, _tasks(), limits=limits, batch_size=4, backend=HFBackend(policy, attention="sdpa"))
    widths = _counting_kernel(monkeypatch)
    flex = HFBackend(policy, attention="flex")
    out = run(policy, _tasks(), limits=limits, batch_size=4, backend=flex)
    assert [t.token_ids for t in out] == [t.token_ids for t in sdpa]
    assert {1, 2} <= set(widths) and flex.cache.flat  # prefills and decode steps went through flex
    assert sum(t.metrics.get("tool_calls", 0) for t in out) >= 3  # rows resumed after their tools
    assert len({len(t.token_ids) for t in out}) == 4
    with pytest.raises(ValueError, match="attention must be one of"):
        HFBackend(policy, attention="flash")


def test_under_autocast_flex_reads_the_bf16_storage(policy):
    """The GRPO recipe rolls out under bf16 autocast: the flat storage holds bf16 keys and flex attends over them."""
    backend = HFBackend(policy, attention="flex")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(policy, _tasks()[:2], limits=RolloutLimits(max_turns=2, max_new_tokens=6), backend=backend)
    assert backend.cache.dtype == torch.bfloat16 and backend.cache.flat
    assert all(t.metrics["sampled_tokens"] > 0 and len(t.token_ids) == len(t.logprobs) for t in out)


def test_flex_bucketed_decode_steps_give_the_eager_tokens(policy):
    """What a CUDA graph records under flex (batch padded into the scratch slot, the block mask made from the static
    buffers inside the forward, one bucket for every key length), run eagerly: the unbucketed tokens."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    tasks = _tasks()[:3]  # three rows: the batch pads to four
    eager = run(policy, tasks, limits=limits, batch_size=3, backend=HFBackend(policy, attention="flex"))
    backend = HFBackend(policy, attention="flex")
    backend.graphs = DecodeGraphs(policy.model, backend.cache, backend._cache_argument, capture=False, attention="flex")
    out = run(policy, tasks, limits=limits, batch_size=3, backend=backend)
    assert [t.token_ids for t in out] == [t.token_ids for t in eager]
    assert {batch for batch, _, _ in backend.graphs.graphs} <= {1, 2, 4}
    assert {keys for _, keys, _ in backend.graphs.graphs} == {backend.cache.capacity}  # one key bucket
    assert all(entry.mask is None for entry in backend.graphs.graphs.values())


def test_a_failed_capture_under_flex_keeps_the_bucketed_decode(policy, monkeypatch):
    """Compiled flex is compiled per batch shape: when a graph cannot be captured, decode stays on the buckets
    (uncaptured) rather than falling back to the real batch sizes, each a recompile. Here the capture raises at once
    (CPU: nothing is captured); the tokens are the eager ones and every step after it ran through a bucket."""
    limits = RolloutLimits(max_turns=3, max_new_tokens=8, temperature=0.0)
    tasks = _tasks()[:3]
    eager = run(policy, tasks, limits=limits, batch_size=3, backend=HFBackend(policy, attention="flex"))
    backend = HFBackend(policy, attention="flex")
    graphs = backend.graphs = DecodeGraphs(policy.model, backend.cache, backend._cache_argument, capture=False,
                                           attention="flex")  # fmt: skip
    graphs.capture = True  # as on CUDA; the first capture fails

    def fail(entry, autocast):
        raise RuntimeError("capture is not supported here")

    monkeypatch.setattr(graphs, "_capture", fail)
    monkeypatch.setattr(graphs, "_drop_graphs", lambda: graphs.graphs.clear())  # no CUDA memory pool on the CPU
    out = run(policy, tasks, limits=limits, batch_size=3, backend=backend)
    assert [t.token_ids for t in out] == [t.token_ids for t in eager]
    assert graphs.failed is None and graphs.capture is False
    assert graphs.graphs and {batch for batch, _, _ in graphs.graphs} <= {1, 2, 4}  # the steps after it: bucketed


def test_decode_buckets_reach_256_rows_and_stop_at_the_row_limit(policy):
    assert [_bucket(n) for n in (1, 3, 64, 65, 200, 256)] == [1, 4, 64, 128, 256, 256]
    assert [_bucket(n, most=320) for n in (3, 256, 257, 320)] == [4, 256, 320, 320]  # a 320-row rollout: no 512
    assert _bucket(300, most=256) == 300  # a cap below the rows never cuts rows off
    # 256 short text rows decoded through the buckets (SDPA; eagerly on the CPU): one 256-row bucket, and the
    # bucketed step's greedy tokens are the plain step's
    prompts = [policy.tokenizer.encode(f"row {i} says {'hi ' * (i % 7)}") for i in range(256)]

    def decode(backend):
        for i, ids in enumerate(prompts):
            backend.submit(TurnRequest(i, ids, [], [], Sampling(max_new_tokens=3, temperature=0.0)))
        tokens = {}
        while backend.busy:
            tokens.update({r.key: r.token_ids for r in backend.step()})
        return [tokens[i] for i in range(256)]

    bucketed = HFBackend(policy, cuda_graphs=False, row_limit=256)
    bucketed.graphs = DecodeGraphs(policy.model, bucketed.cache, bucketed._cache_argument, capture=False,
                                   max_batch=256)  # fmt: skip
    assert decode(bucketed) == decode(HFBackend(policy, cuda_graphs=False))
    assert max(batch for batch, _, _ in bucketed.graphs.graphs) == 256


def test_rollout_attention_is_a_checked_config_key_that_grpo_hands_its_sampler(policy):
    import types

    from vagent.config import ConfigError, GRPOConfig, load_config
    from vagent.recipes.grpo import _Run

    required = ["data.train=x", "model.path=y"]
    cfg = load_config(GRPOConfig, None, [*required, "rollout.attention=flex", "rollout.kv_cache_gb=null"])
    assert load_config(GRPOConfig, None, required).rollout.attention == "sdpa"
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(GRPOConfig, None, [*required, "rollout.attention=flash"])
    run_state = types.SimpleNamespace(cfg=cfg, sampler=None)  # the two fields generation_backend reads
    sampler = _Run.generation_backend(run_state, policy)
    assert sampler.attention == "flex" and sampler.cache.flat


@pytest.mark.gpu
def test_flex_on_cuda_compiled_and_graphed_samples_the_sdpa_tokens(tiny_qwen25):
    """On CUDA flex runs compiled and its decode steps replay CUDA graphs: the SDPA backend's greedy tokens (fp32),
    and it runs under bf16 autocast, the GRPO recipe's."""
    from vagent.model import load_policy

    policy = load_policy(tiny_qwen25, device="cuda", dtype="float32")
    limits = RolloutLimits(max_turns=4, max_new_tokens=10, temperature=0.0)
    sdpa = run(policy, _tasks(), limits=limits, batch_size=4, backend=HFBackend(policy))
    flex = HFBackend(policy, attention="flex")
    out = run(policy, _tasks(), limits=limits, batch_size=4, backend=flex)
    assert flex.graphs.failed is None and flex.stats().graph_captures > 0
    assert [t.token_ids for t in out] == [t.token_ids for t in sdpa]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast = run(policy, _tasks(), limits=limits, batch_size=4, backend=HFBackend(policy, attention="flex"))
    assert all(t.metrics["sampled_tokens"] > 0 for t in cast)
