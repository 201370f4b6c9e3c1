import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from vagent.model import PolicyLoadError, load_policy, mm_token_type_ids, resolve_attn_implementation, token_logprobs
from vagent.rollout import generate
from vagent.tiny_model import SPECIAL_TOKENS, build_tiny_checkpoint

IMAGE = Image.new("RGB", (320, 240), (30, 140, 200))


def _messages(text="What color is this?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _prompt(text="What color is this?", image=IMAGE):
    """``_messages`` as the ``Message`` list ``vagent.rollout.generate`` takes."""
    from vagent.types import ContentPart, Message

    return [Message("user", [ContentPart("image", image=image), ContentPart("text", text)])]


def test_tiny_checkpoint_loads_with_plain_transformers(tiny_qwen25):
    files = {p.name for p in tiny_qwen25.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= files
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen25)
    processor = AutoProcessor.from_pretrained(tiny_qwen25)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    # special token ids in the config match the tokenizer's
    tok = processor.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.text_config.vocab_size == len(tok)


def test_tokenizer_carries_the_family_tokens_and_round_trips_any_text(policy):
    tok = policy.tokenizer
    for token in [*SPECIAL_TOKENS, "<tool_call>", "</tool_call>"]:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token
    text = 'Zoom 3× into "région" — {"bbox": [1, 2, 3, 4]} 数字 🙂\n\tend'
    assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is unknown
    assert tok.decode(tok.encode("<tool_call>x</tool_call>"), skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_chat_template_renders_all_roles_with_images(policy):
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "OBS"}]},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "V"}]},
    ]
    text = policy.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nSYS<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>OBS\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>V<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_load_policy_picks_sdpa_on_cpu_and_knows_the_convention(policy, tiny_qwen2):
    assert policy.family == "qwen2_5_vl" and policy.coord_convention == "absolute"
    assert policy.model.config._attn_implementation == "sdpa"
    assert policy.dtype == torch.float32 and policy.device.type == "cpu"
    assert policy.pixel_budget == (28 * 28 * 4, 28 * 28 * 256)
    qwen2 = load_policy(tiny_qwen2, device="cpu")
    assert qwen2.family == "qwen2_vl" and qwen2.coord_convention == "norm1000"
    out = generate(qwen2, _prompt(), max_new_tokens=4)
    assert 1 <= len(out[0].token_ids) <= 4


def test_load_policy_errors_are_clear(tmp_path, tiny_qwen25):
    with pytest.raises(PolicyLoadError, match="checkpoint dir not found"):
        load_policy(tmp_path / "nope")
    with pytest.raises(PolicyLoadError, match="no config.json"):
        load_policy(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PolicyLoadError, match="'llama' model; vagent supports"):
        load_policy(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PolicyLoadError, match="not valid JSON"):
        load_policy(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_qwen25 / "config.json").read_text())  # config but no weights
    with pytest.raises(PolicyLoadError, match="could not load"):
        load_policy(broken)
    with pytest.raises(PolicyLoadError, match="needs a CUDA device"):
        load_policy(tiny_qwen25, device="cpu", attn_implementation="flash_attention_2")


def test_attention_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attn_implementation(None, cpu) == "sdpa"
    assert resolve_attn_implementation("eager", cpu) == "eager"
    with pytest.raises(PolicyLoadError, match="must be"):
        resolve_attn_implementation("xformers", cpu)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert resolve_attn_implementation(None, cuda) == "sdpa"
        with pytest.raises(PolicyLoadError, match=r"pip install 'vagent\[gpu\]'"):
            resolve_attn_implementation("flash_attention_2", cuda)


def test_token_logprobs_match_generation_and_use_multimodal_rope(policy):
    inputs = policy.prepare(_messages(), [IMAGE])
    gen = generate(policy, _prompt(), max_new_tokens=6)[0]
    assert gen.prompt_tokens == inputs["input_ids"].shape[1]  # the engine's encoder renders the same prompt
    full = torch.cat([inputs["input_ids"], torch.tensor([gen.token_ids])], dim=1)
    batch = {
        "input_ids": full,
        "attention_mask": torch.ones_like(full),
        "pixel_values": inputs["pixel_values"],
        "image_grid_thw": inputs["image_grid_thw"],
    }
    with torch.no_grad():
        # mm_token_type_ids derived inside; the sampler never draws a vision placeholder: out of its distribution
        scores = token_logprobs(policy.model, batch, suppress=policy.vision_placeholder_ids)
    n = len(gen.token_ids)
    assert scores.shape == full.shape and scores[0, 0] == 0
    assert scores[0, -n:].tolist() == pytest.approx(gen.logprobs, abs=1e-4)
    # Positions matter: forcing 1-D RoPE (what transformers silently does without mm_token_type_ids) changes scores.
    model = policy.model
    with torch.no_grad():
        flat = model(**batch, position_ids=torch.arange(full.shape[1])[None].expand(3, 1, -1)).logits
    flat_lp = torch.log_softmax(flat[0, :-1].float(), -1).gather(-1, full[0, 1:, None]).squeeze(-1)
    assert not torch.allclose(flat_lp[-n:], scores[0, -n:], atol=1e-4)


def test_token_logprobs_not_affected_by_stale_rope_deltas(policy):
    other = Image.new("RGB", (600, 200), (250, 10, 10))  # different grid -> different rope_deltas
    inputs = policy.prepare(_messages(), [IMAGE])
    batch = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        fresh = token_logprobs(policy.model, batch)
        policy.model.generate(**policy.prepare(_messages("another"), [other]), max_new_tokens=3)  # caches deltas
        after = token_logprobs(policy.model, batch)
    assert torch.equal(fresh, after)


def test_mm_token_type_ids():
    ids = torch.tensor([[5, 9, 9, 7, 8]])
    assert mm_token_type_ids(ids, image_token_id=9, video_token_id=8).tolist() == [[0, 1, 1, 0, 2]]


def test_tiny_checkpoint_is_deterministic_and_written_atomically(tmp_path):
    a = build_tiny_checkpoint(tmp_path / "a", size="nano", seed=3)
    b = build_tiny_checkpoint(tmp_path / "b", size="nano", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dirs left behind
    with pytest.raises(ValueError, match="size must be one of"):
        build_tiny_checkpoint(tmp_path / "c", size="huge")
    assert not (tmp_path / "c").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "auto"])
def test_bf16_on_gpu(tiny_qwen25, attn):
    policy = load_policy(tiny_qwen25, device="cuda", dtype="bfloat16", attn_implementation=attn)
    assert policy.dtype == torch.bfloat16
    out = generate(policy, _prompt(), max_new_tokens=8)[0]
    assert 1 <= len(out.token_ids) <= 8


def test_qwen3_vl_checkpoint_loads_and_generates(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "q3", family="qwen3_vl", size="nano", min_pixels=32 * 32 * 4)
    assert type(AutoModelForImageTextToText.from_pretrained(path)).__name__ == "Qwen3VLForConditionalGeneration"
    policy = load_policy(path, device="cpu")
    assert policy.family == "qwen3_vl" and policy.coord_convention == "norm1000" and policy.image_factor == 32
    out = generate(policy, _prompt(), max_new_tokens=4)[0]
    assert 1 <= len(out.token_ids) <= 4


def test_frame_names_the_budget_grid_and_convention_data_builders_need(policy):
    min_pixels, max_pixels = policy.pixel_budget
    assert policy.frame == {"min_pixels": min_pixels, "max_pixels": max_pixels, "factor": 28, "convention": "absolute"}


def _tool_batch(policy, n=3):
    """Right-padded gold conversations that share the crop tool's system prompt, then differ (images, text)."""
    from vagent.chat import system_prompt
    from vagent.data import encode_messages
    from vagent.data.batching import collate
    from vagent.toolbox import tool_schemas
    from vagent.types import ContentPart, Message

    min_pixels, max_pixels = policy.pixel_budget
    encoded = []
    for i in range(n):
        image = Image.new("RGB", (200 + 60 * i, 160), (40 * i, 120, 200 - 30 * i))
        crop = Image.new("RGB", (112, 84), (200, 20 * i, 30))
        messages = [
            Message.text("system", system_prompt(tool_schemas(["crop"]))),
            Message("user", [ContentPart("image", image=image), ContentPart("text", "What is on the tile?" * (i + 1))]),
            Message.text("assistant", '<tool_call>{"name": "crop", "arguments": {"bbox": [1, 2, 60, 70]}}</tool_call>'),
            Message("tool", [ContentPart("image", image=crop), ContentPart("text", "Image 1: cropped region.")]),
            Message.text("assistant", f"<answer>digit {i}</answer>"),
        ]
        encoded.append(encode_messages(messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels))
    return collate(encoded, policy.tokenizer.pad_token_id)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_shared_prefix_forward_matches_the_full_forward_gradients_included(tmp_path, family):
    from vagent.algorithms.sft import token_nll_sum, trained_positions
    from vagent.model import policy_logits, shared_prefix_length

    path = build_tiny_checkpoint(tmp_path / family, family=family, size="nano", min_pixels=32 * 32 * 4)
    policy = load_policy(path, device="cpu")
    batch = _tool_batch(policy)
    model = policy.model
    prefix = shared_prefix_length(model, batch)
    ids = batch["input_ids"]
    # the system prompt and the user header, up to the first image token; rows are padded to different lengths
    assert prefix > 100 and (ids[:, :prefix] == ids[:1, :prefix]).all() and (ids[:, prefix] == ids[0, prefix]).all()
    assert batch["attention_mask"].sum(1).unique().numel() == 3

    def run(share, keep=0, positions=None):
        model.zero_grad()
        logits = policy_logits(model, batch, logits_to_keep=keep, share_prefix=share, positions=positions)
        if keep:
            return logits.detach(), None
        token_nll_sum(logits, ids, batch["loss_mask"]).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    full, full_grads = run(False)
    assert len(calls) == 1  # row by row: one forward
    shared, shared_grads = run(True)
    assert len(calls) == 3  # the prefix once, then the rows' own parts
    hook.remove()
    real = batch["attention_mask"].bool()
    assert torch.allclose(full[real], shared[real], atol=1e-4)
    assert full_grads.keys() == shared_grads.keys() and len(full_grads) > 10
    for name, grad in full_grads.items():
        assert torch.allclose(grad, shared_grads[name], atol=1e-6, rtol=1e-3), name
    # the head on the trained positions alone: the same logits there and the same gradients, shared or not
    trained = trained_positions(batch["loss_mask"])
    assert 0 < int(trained.sum()) < int(real.sum())
    for share in (False, True):
        picked, picked_grads = run(share, positions=trained)
        assert picked.shape == (int(trained.sum()), full.shape[-1])
        assert torch.allclose(picked, full[trained], atol=1e-4)
        assert picked_grads.keys() == full_grads.keys()
        for name, grad in full_grads.items():
            assert torch.allclose(grad, picked_grads[name], atol=1e-6, rtol=1e-3), name
    with pytest.raises(ValueError, match="not both"):
        policy_logits(model, batch, logits_to_keep=3, positions=trained)
    width = ids.shape[1]
    for keep in (5, width - prefix, width - prefix + 7):  # the rows' own part only, exactly it, and into the prefix
        kept, _ = run(True, keep)
        assert kept.shape[1] == keep
        assert torch.allclose(kept[real[:, -keep:]], full[:, -keep:][real[:, -keep:]], atol=1e-4)


def test_shared_prefix_is_only_taken_where_it_is_exact(policy):
    from vagent.model import MIN_SHARED_PREFIX, shared_prefix_length

    batch = _tool_batch(policy)
    model = policy.model
    prefix = shared_prefix_length(model, batch)
    assert prefix > MIN_SHARED_PREFIX
    one = {k: v[:1] for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    assert shared_prefix_length(model, one) == 0  # nothing to share with
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    assert shared_prefix_length(model, left) == 0  # left padding: the rows' real tokens do not line up
    first_image = int((batch["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    assert prefix <= first_image
    ids = batch["input_ids"].clone()
    ids[1, 3] = ids[1, 3] + 1  # rows that part after 3 tokens share too little to be worth a second call
    assert shared_prefix_length(model, dict(batch, input_ids=ids)) == 0

    class Wrapper(torch.nn.Module):  # DDP / DeepSpeed: one forward per backward
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert shared_prefix_length(Wrapper(model), batch) == 0
    positions = torch.arange(batch["input_ids"].shape[1]).expand(3, 3, -1)
    assert shared_prefix_length(model, dict(batch, position_ids=positions)) == 0  # the caller's positions win
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert shared_prefix_length(model, batch) == 0  # the replayed forward would write the cache again
    finally:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert shared_prefix_length(model, batch) == prefix


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_patch_embedding_runs_as_a_matmul_with_the_convolutions_numbers(tmp_path, family):
    from vagent.model import patch_embeds_as_matmul

    path = build_tiny_checkpoint(tmp_path / family, family=family, size="nano", min_pixels=32 * 32 * 4)
    policy = load_policy(path, device="cpu")
    proj = policy.model.model.visual.patch_embed.proj
    assert "_conv_as_matmul" in repr(proj.forward)  # load_policy switched it
    assert patch_embeds_as_matmul(policy.model) == 1  # and switching again is harmless
    x = torch.randn(37, *proj.weight.shape[1:], requires_grad=True)
    out = proj(x)
    ref = torch.nn.functional.conv3d(x, proj.weight, proj.bias, stride=proj.stride)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad_w, grad_x = torch.autograd.grad(out.square().sum(), (proj.weight, x))
    ref_w, ref_x = torch.autograd.grad(ref.square().sum(), (proj.weight, x))
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-4, atol=1e-4)
    wide = torch.randn(2, proj.weight.shape[1], *(2 * k for k in proj.kernel_size))  # not one kernel: the conv
    torch.testing.assert_close(proj(wide), torch.nn.functional.conv3d(wide, proj.weight, proj.bias, stride=proj.stride))
    assert list(policy.model.state_dict()) == list(AutoModelForImageTextToText.from_pretrained(path).state_dict())
