"""The chunked language-model head: the same log-probs, entropy and gradients as whole logits, never whole logits."""

import pytest
import torch

from vagent.algorithms import chunked_token_logprobs, sampled_logprobs, token_nll_sum, trained_positions
from vagent.config import ConfigError, GRPOConfig, SFTConfig, load_config
from vagent.data.batching import collate
from vagent.data.encode import encode_messages
from vagent.model import masked_token_logprobs, policy_logits, token_logprobs

# fp32 throughout: the chunked and the whole computation differ only by summation order.
TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_grads_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """A whole model's parameter gradients: 5e-5 of the tensor's norm, and 1e-3 of each entry. The rounding of the
    head's sums travels back through every layer: at 151,936 rows the gradients of the vision and first decoder
    layers differed by up to 1.1e-5 of their norm (three draws of the sampled tokens), and the embedding row of "\n"
    (summed over many positions, 0.06) by 2e-5 in one entry of 4.9 million. A wrong chunk is off by far more."""
    assert float((got - want).norm()) <= 5e-5 * float(want.norm()) + 1e-8, name
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


class _RowCountingHead(torch.nn.Linear):
    """A head that records how many rows each call saw: forward and backward's recompute must both stay chunked."""

    calls: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return super().forward(x)


def _whole(hidden, head, targets, temperature):
    log_p = torch.log_softmax(head(hidden).float() / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum()


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_whole_computations_values_entropy_and_gradients(chunk_size, temperature):
    torch.manual_seed(0)
    n, hidden_size, vocab = 37, 16, 1000
    head = _RowCountingHead(hidden_size, vocab, bias=True)
    head.calls = []
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    weights = torch.randn(n)  # a loss that weighs every token differently, like an advantage

    lp, entropy = chunked_token_logprobs(hidden, head, targets, chunk_size=chunk_size, temperature=temperature)
    (lp * weights).sum().backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    assert max(head.calls) <= chunk_size  # forward and backward's recompute alike
    assert len(head.calls) == 2 * -(-n // chunk_size)  # each chunk once forward, once recomputed in backward

    hidden.grad = None
    head.zero_grad()
    want_lp, want_entropy = _whole(hidden, head, targets, temperature)
    (want_lp * weights).sum().backward()
    torch.testing.assert_close(lp, want_lp, **TOL)
    torch.testing.assert_close(entropy, want_entropy, **TOL)
    for got, want in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert entropy.grad_fn is None


def test_without_gradients_nothing_is_recomputed_and_empty_selections_keep_the_head_in_the_graph():
    head = _RowCountingHead(4, 10)
    head.calls = []
    with torch.no_grad():
        lp, _ = chunked_token_logprobs(torch.randn(5, 4), head, torch.zeros(5, dtype=torch.long), chunk_size=2)
    assert head.calls == [2, 2, 1] and lp.shape == (5,)
    empty, _ = chunked_token_logprobs(torch.randn(0, 4), head, torch.zeros(0, dtype=torch.long), chunk_size=2)
    empty.sum().backward()  # DDP needs every parameter to get a gradient, zero or not
    assert head.weight.grad is not None and not head.weight.grad.any()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(torch.randn(2, 4), head, torch.zeros(2, dtype=torch.long), chunk_size=0)


def _batch(policy):
    """Two trajectories of different lengths (left padding), sampled tokens masked 1, with an image each."""
    from PIL import Image

    from vagent.rollout import RolloutLimits, Task, run

    image = Image.new("RGB", (448, 336), (30, 120, 200))
    torch.manual_seed(0)
    tasks = [Task(id=f"t{i}", question="What?" * (i + 1), images=[image]) for i in range(2)]
    trajectories = run(policy, tasks, limits=RolloutLimits(max_turns=1, max_new_tokens=10, temperature=1.0))
    min_pixels, max_pixels = policy.pixel_budget
    encoded = [encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
               for t in trajectories]  # fmt: skip
    return collate(encoded, policy.tokenizer.pad_token_id)


@pytest.mark.parametrize(
    ("policy", "share_prefix"),
    [("trained_vocab", False), ("trained_vocab", True), ("qwen_vocab", True)],
    indirect=["policy"],
)
def test_the_models_chunked_log_probs_and_sft_loss_equal_whole_logits_with_gradients(policy, share_prefix):
    model = policy.model
    batch = _batch(policy)
    mask = batch["loss_mask"]
    assert int(mask.sum()) > 0
    advantages = torch.tensor([1.0, -0.5])

    def grads_of(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp, entropy = masked_token_logprobs(model, batch, mask, chunk_size=5, share_prefix=share_prefix)
    chunked = grads_of((lp * advantages[:, None]).sum())
    whole_lp, whole_entropy = sampled_logprobs(policy_logits(model, batch, share_prefix=share_prefix),
                                               batch["input_ids"], mask)  # fmt: skip
    whole = grads_of((whole_lp * advantages[:, None]).sum())
    torch.testing.assert_close(lp, whole_lp, **TOL)
    torch.testing.assert_close(entropy, whole_entropy, rtol=1e-5, atol=1e-4)
    assert chunked.keys() == whole.keys() and len(chunked) > 10
    for name in chunked:
        _assert_grads_close(chunked[name], whole[name], name)

    # SFT's loss: the summed NLL of the trained tokens, against cross-entropy over the trained positions' logits
    nll = -masked_token_logprobs(model, batch, mask, chunk_size=3, share_prefix=share_prefix)[0].sum()
    chunked = grads_of(nll)
    logits = policy_logits(model, batch, share_prefix=share_prefix, positions=trained_positions(mask))
    want = token_nll_sum(logits, batch["input_ids"], mask)
    whole = grads_of(want)
    torch.testing.assert_close(nll, want, **TOL)
    for name in chunked:
        _assert_grads_close(chunked[name], whole[name], name)
    model.zero_grad()


def test_token_logprobs_scores_every_position_like_a_log_softmax_of_the_logits(policy):
    batch = _batch(policy)
    with torch.no_grad():
        got = token_logprobs(policy.model, batch, chunk_size=4)
        log_p = torch.log_softmax(policy_logits(policy.model, batch).float(), dim=-1)
    want = torch.nn.functional.pad(log_p[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1), (1, 0))
    torch.testing.assert_close(got, want, **TOL)


def test_the_head_settings_are_checked_at_load():
    paths = ["model.path=m", "data.train=rows.jsonl"]  # required by the recipes; nothing is loaded here
    assert load_config(SFTConfig, None, paths).train.lm_head_chunk == 1024
    with pytest.raises(ConfigError, match="lm_head_chunk"):
        load_config(SFTConfig, None, [*paths, "train.lm_head_chunk=-1"])
    with pytest.raises(ConfigError, match="liger is for SFT"):
        load_config(GRPOConfig, None, [*paths, "train.lm_head_kernel=liger"])


def test_liger_without_the_package_says_how_to_get_it_or_what_to_use(policy, monkeypatch):
    import sys

    from vagent.model import liger_token_nll_sum

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as if not installed (it needs CUDA and Triton)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)
    batch = _batch(policy)
    with pytest.raises(ImportError, match=r"pip install liger-kernel.*lm_head_kernel=chunked"):
        liger_token_nll_sum(policy.model, batch, batch["loss_mask"])
