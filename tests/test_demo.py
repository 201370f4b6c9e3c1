"""The Gradio demo: upload checks, turn rendering, streaming, errors that leave the app serving, and an
end-to-end browser test (Playwright driving Debian's Chromium) against the app started as `vagent demo`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from demo.episode import (
    DemoLimits,
    Event,
    Looked,
    UploadError,
    build_task,
    check_upload,
    clamp_limits,
    describe_call,
    render_turn,
    stream_episode,
)
from tests.videos import write_video
from vagent.rollout import Task
from vagent.types import ContentPart, Message, Observation

REPO = Path(__file__).resolve().parent.parent


def _png(path: Path, size=(320, 240)) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


# -- uploads ---------------------------------------------------------------------------------------------


def test_good_uploads_pass(tmp_path):
    image = check_upload(_png(tmp_path / "a.png"), DemoLimits())
    assert image.kind == "image" and image.image.size == (320, 240)
    video = check_upload(write_video(tmp_path / "v.mp4", frames=16), DemoLimits())
    assert video.kind == "video" and 1.5 < video.duration_s < 2.5


@pytest.mark.parametrize(
    ("make", "limits", "message"),
    [
        (lambda d: None, DemoLimits(), "Upload an image or a video"),
        (lambda d: (d / "text.png").write_text("just text, not a PNG") and d / "text.png", DemoLimits(),
         "text.png is not a usable image"),
        (lambda d: _png(d / "big.png", (1200, 1000)), DemoLimits(max_image_pixels=1_000_000),
         "above the limit of 1,000,000"),
        (lambda d: _png(d / "heavy.png"), DemoLimits(max_upload_mb=0.01), "up to 0.01 MB"),
        (lambda d: (d / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(2000)) and d / "broken.mp4",
         DemoLimits(), "broken.mp4 is not a readable video"),
        (lambda d: write_video(d / "long.mp4", frames=24), DemoLimits(max_video_s=1.0), "videos up to 1 s"),
    ],
)  # fmt: skip
def test_bad_uploads_get_a_message(tmp_path, make, limits, message):
    with pytest.raises(UploadError, match=message) as e:
        check_upload(make(tmp_path), limits)
    assert str(tmp_path) not in str(e.value)  # the server's paths stay on the server


def test_questions_and_settings_are_bounded(tmp_path):
    upload = check_upload(_png(tmp_path / "a.png"), DemoLimits())
    with pytest.raises(UploadError, match="Type a question"):
        build_task(upload, "   ", ["crop"], DemoLimits())
    with pytest.raises(UploadError, match="limit is 10"):
        build_task(upload, "x" * 11, ["crop"], DemoLimits(max_question_chars=10))
    task = build_task(upload, " What is it? ", ["crop"], DemoLimits())
    assert task.question == "What is it?" and task.images[0] is upload.image
    limits = clamp_limits(DemoLimits(max_turns=3, max_new_tokens=64), temperature=9, max_turns=50, max_new_tokens=1)
    assert (limits.max_turns, limits.max_new_tokens, limits.temperature) == (3, 8, 2.0)


# -- rendering -------------------------------------------------------------------------------------------


def test_turns_render_readably():
    text = '<think>The tile is tiny.</think>\n<tool_call>{"name": "crop", "arguments": {"bbox": [10, 20, 60.5, 80]}}</tool_call>'
    turn = Message("assistant", [ContentPart("text", text)], token_ids=[1] * 30, sampled=[1] * 28 + [0, 0])
    out = render_turn(Event("turn", 1.25, message=turn), 2)
    assert out[0]["content"].startswith("**Turn 2** · 28 tokens · 1.2 s") and "> The tile is tiny." in out[0]["content"]
    assert out[1]["content"] == "**Tool call →** crop image 0 at [10, 20, 60.5, 80]"

    bad = Message("assistant", [ContentPart("text", "<tool_call>{not json</tool_call>")])
    assert "Malformed tool call (bad_json)" in render_turn(Event("turn", 0.1, message=bad), 1)[1]["content"]
    done = Message("assistant", [ContentPart("text", "<think>ok</think><answer>7</answer>")])
    assert render_turn(Event("turn", 0.1, message=done), 3)[-1]["content"] == "**Answer:** 7"

    crop = Image.new("RGB", (56, 84))
    tool = Message("tool", [ContentPart("text", "Image 1: cropped region."), ContentPart("image", image=crop)])
    out = render_turn(Event("turn", 0.3, message=tool, observation=Observation("x", images=[crop])), 2)
    assert out[0]["content"].startswith("**Tool result** · 0.3 s") and "returned image (56x84 px" in out[0]["content"]
    assert out[1]["content"].size == (149, 224)  # shown enlarged, pixel for pixel
    placed = Observation("x", images=[crop], first_image=3)  # the engine's index of the image
    assert (
        "returned image 3 (56x84 px"
        in render_turn(Event("turn", 0.3, message=tool, observation=placed), 2)[0]["content"]
    )
    frames = Message(
        "tool", [ContentPart("text", "2 frames"), ContentPart("image", image=crop), ContentPart("image", image=crop)]
    )
    observation = Observation("2 frames", images=[crop, crop], timestamps=[1.0, 1.5])
    assert [m.get("caption") for m in render_turn(Event("turn", 0.1, message=frames, observation=observation), 1)[1:]] == [
        "frame at 1.00 s", "frame at 1.50 s"]  # fmt: skip
    many = Observation("8 frames", images=[crop] * 8, timestamps=[0.5 * k for k in range(8)])
    out = render_turn(
        Event("turn", 0.1, message=Message("tool", [ContentPart("image", image=crop)] * 8), observation=many), 1
    )
    assert len(out) == 2 and out[1]["content"].size == (
        4 * 120 + 3 * 4,
        2 * 180 + 4,
    )  # one grid, not a message per frame
    assert (
        describe_call("search", {"query": "tallest <b>tower</b>"})
        == "search the web for “tallest &lt;b&gt;tower&lt;/b&gt;”"
    )
    assert describe_call("code", {"code": "print(1)"}).endswith("```python\nprint(1)\n```")


def test_stream_episode_yields_turns_as_they_happen(policy, tmp_path):
    image = Image.open(_png(tmp_path / "a.png")).convert("RGB")
    w, h = policy.model_view(image).size
    call = f'<tool_call>{{"name": "crop", "arguments": {{"bbox": [0, 0, {w // 2}, {h // 2}]}}}}</tool_call>'
    task = Task(
        id="t", question="What is there?", images=[image], tools=["crop"], scripted_turns=[call, "<answer>a</answer>"]
    )
    events = list(stream_episode(policy, task, clamp_limits(DemoLimits(), 0.0, 4, 16)))
    assert [e.kind for e in events] == ["turn", "turn", "turn", "done"]
    assert [e.message.role for e in events[:3]] == ["assistant", "tool", "assistant"]
    assert events[1].observation.metadata["box_original"] == [0, 0, 160, 120]
    looked = Looked(image=image)
    for event in events[:3]:
        looked.add(event.observation)
    assert looked.boxes == [[0, 0, 160, 120]]
    picture = np.asarray(looked.picture())
    assert tuple(picture[60, 159]) == (0xFF, 0x2D, 0x55)  # the box's right edge is drawn in the first box colour
    assert events[-1].trajectory.answer == "a"


def test_a_video_episode_shows_frames_and_a_timeline_of_what_was_sampled(policy, tmp_path):
    upload = check_upload(write_video(tmp_path / "v.mp4", frames=32), DemoLimits())
    assert upload.poster.height == 120 and upload.poster.width > 4 * 120  # four frames side by side
    calls = ['<tool_call>{"name": "sample_frames", "arguments": {"num_frames": 4}}</tool_call>',
             '<tool_call>{"name": "crop_clip", "arguments": {"start": 1.0, "end": 2.0}}</tool_call>', "<answer>grey</answer>"]  # fmt: skip
    task = build_task(upload, "What happens?", ["sample_frames", "crop_clip"], DemoLimits())
    task.scripted_turns = calls
    looked = Looked(duration=upload.duration_s)
    for event in stream_episode(policy, task, clamp_limits(DemoLimits(), 0.0, 4, 16)):
        if event.kind == "turn":
            looked.add(event.observation)
    assert event.kind == "done" and event.trajectory.stop_reason == "answered"
    assert [span for span, _ in looked.spans] == [[0.0, 4.0], [1.0, 2.0]] and len(looked.spans[0][1]) == 4
    assert looked.picture().size == (960, 40 + 2 * 34 + 10)  # the timeline: one row per video-tool call


def test_a_failing_request_shows_an_error_and_the_app_keeps_serving(policy, tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    import demo.episode
    from demo.app import Served, answer

    served = Served(policy, tmp_path, "", ["crop"], {}, DemoLimits(max_turns=2, max_new_tokens=16))
    image = str(_png(tmp_path / "a.png"))
    *_, (history, looked, status) = answer(served, str(tmp_path / "missing.png"), "q", ["crop"], 0.0, 2, 16, 0)
    assert history == [] and status.startswith("**Error:**") and "did not arrive" in status

    real = demo.episode.rollout

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(demo.episode, "rollout", broken)
    *_, (history, looked, status) = answer(served, image, "What is it?", ["crop"], 0.0, 2, 16, 0)
    assert "the episode failed: RuntimeError: CUDA out of memory (simulated)" in status
    assert looked is not None and len(history) == 2  # the question stays on screen

    monkeypatch.setattr(demo.episode, "rollout", real)
    updates = list(answer(served, image, "What is it?", ["crop"], 0.0, 2, 16, 0))
    assert updates[-1][2].startswith("**Done**") and len(updates) >= 3  # streamed: started, turn(s), done


def test_without_a_model_the_demo_picks_the_quickstart_policy_or_warns(tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    import vagent.tiny_model
    from demo.app import RANDOM_MODEL_WARNING, pick_model

    built = []
    monkeypatch.setattr(vagent.tiny_model, "build_tiny_checkpoint", lambda out, **kw: built.append(out))
    model, note = pick_model(None, tmp_path)
    assert model == tmp_path / "demo" / "tiny-random" and note == RANDOM_MODEL_WARNING and built == [model]
    assert "writes nonsense" in note and "--model" in note
    (tmp_path / "quickstart" / "sft" / "model").mkdir(parents=True)
    (tmp_path / "quickstart" / "sft" / "model" / "config.json").write_text("{}")
    model, note = pick_model(None, tmp_path)
    assert model == tmp_path / "quickstart" / "sft" / "model" and "SFT policy" in note
    assert pick_model("/x/Qwen2.5-VL-7B", tmp_path)[0] == Path("/x/Qwen2.5-VL-7B")


def test_a_missing_model_is_one_clear_error(tmp_path, capsys):
    pytest.importorskip("gradio")
    from demo.app import main

    assert main(["--model", str(tmp_path / "nowhere"), "--runs", str(tmp_path)]) == 2
    assert "vagent demo: error: checkpoint dir not found" in capsys.readouterr().err


# -- end to end in a browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_stack():
    """Chromium's path and playwright's sync API, or a skip: checked before the fixture below trains a model."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (`make test` installs it as root: apt-get install chromium)")
    pytest.importorskip("gradio")
    return chromium, pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def tool_calling_model(tmp_path_factory, tiny_qwen25, zoom_rows_file):
    """A tiny Qwen2.5-VL fine-tuned (SFT, about 20 s) on two gold crop-then-answer trajectories, so that it
    calls the crop tool on its own: the browser test needs a policy that really uses a tool."""
    from vagent.config import load_config
    from vagent.recipes import sft

    out = tmp_path_factory.mktemp("demo-sft")
    cfg = load_config(sft.SFTConfig, None, [f"out_dir={out}", f"model.path={tiny_qwen25}", f"data.train={zoom_rows_file(2, 0)}",
                                            "data.micro_batch_size=2", "optim.lr=3e-3", "optim.min_lr_ratio=0.3",
                                            "train.max_steps=150", "train.precision=fp32", "train.tensorboard=false",
                                            "model.device=cpu"])  # fmt: skip
    return sft.train(cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_browser_end_to_end(browser_stack, tool_calling_model, tmp_path):
    chromium, playwright = browser_stack
    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.model import load_policy

    frame = load_policy(tool_calling_model, device="cpu").frame
    row = zoom_rows(tmp_path / "data", 1, seed=99, direct_share=0.0, **frame)[0]  # an image it was not trained on
    bad_png = tmp_path / "notes.png"
    bad_png.write_text("a text file renamed .png")
    big = _png(tmp_path / "huge.png", (1200, 1000))
    bad_video = tmp_path / "clip.mp4"
    bad_video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(4000))

    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vagent.cli", "demo", "--model", str(tool_calling_model), "--runs", str(tmp_path / "runs"),
         "--port", str(port), "--device", "cpu", "--max-image-pixels", "1000000"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the demo did not come up: " + (tmp_path / "server.log").read_text()
                time.sleep(0.5)

        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#upload input[type=file]", state="attached")  # the page is built by script
            status = page.locator("#status")

            def upload(path: Path, expect: str) -> None:
                if page.locator("#upload input[type=file]").count() == 0:
                    page.locator("#upload button[aria-label='Clear']").click()
                page.set_input_files("#upload input[type=file]", str(path))
                playwright.expect(status).to_contain_text(expect, timeout=30_000)

            def ask(question: str, expect: str) -> None:
                page.fill("#question textarea", question)
                page.click("#ask")
                playwright.expect(status).to_contain_text(expect, timeout=120_000)

            # A generated image and a question: the trajectory streams in with a tool call and the crop it returned.
            upload(Path(row.images[0]), "Ready: a 896x672 image")
            ask(row.question, "Done in")
            trajectory = page.locator("#trajectory")
            playwright.expect(trajectory).to_contain_text("Tool call → crop image 0 at")
            playwright.expect(trajectory).to_contain_text("Tool result")
            playwright.expect(trajectory).to_contain_text("returned image 1 (")
            assert trajectory.locator("img").count() >= 2  # the uploaded image and the crop
            assert page.locator("#looked img").count() == 1  # the original with the crop box drawn
            page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
            assert (tmp_path / "demo.png").stat().st_size > 10_000

            # Bad uploads: a message each, at upload and on asking; the app keeps serving.
            for path, message in [(bad_png, "notes.png is not a usable image"),
                                  (big, "above the limit of 1,000,000"),
                                  (bad_video, "clip.mp4 is not a readable video")]:  # fmt: skip
                upload(path, message)
                ask("What is this?", message)
            upload(Path(row.images[0]), "Ready")
            ask(row.question, "Done in")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    logged = (tmp_path / "server.log").read_text()
    if "Traceback" in logged:  # pytest.fail, not assert: pytest cuts a failed assert's explanation to a few lines
        pytest.fail("the demo server logged a traceback:\n" + logged[max(0, logged.find("Traceback") - 500) :])


def test_the_demo_offers_the_tools_its_agent_profile_can_call(tiny_qwen25, tmp_path):
    pytest.importorskip("gradio")
    from demo.app import parse_args, serve

    served, _ = serve(parse_args(["--model", str(tiny_qwen25), "--runs", str(tmp_path), "--agent", "deepeyes"]))
    assert served.tools == ["crop", "rotate"]  # DeepEyes' protocol names no other tool
    served, _ = serve(parse_args(["--model", str(tiny_qwen25), "--runs", str(tmp_path)]))
    assert {"crop", "rotate", "sample_frames", "crop_clip"} <= set(served.tools)


def test_a_seed_repeats_a_sampled_episode_and_another_seed_does_not(policy, tmp_path):
    """The demo's seed fixes every sampled turn (``RolloutLimits.sampling_seed``), as on the vLLM backend
    (tests/test_vllm_demo.py)."""
    image = Image.open(_png(tmp_path / "a.png")).convert("RGB")
    limits = clamp_limits(DemoLimits(), 1.5, 2, 16)

    def sampled(seed):
        task = Task(id="t", question="What is there?", images=[image], tools=["crop"])
        *_, done = stream_episode(policy, task, limits, seed=seed)
        return done.trajectory.token_ids

    first = sampled(3)
    assert sampled(3) == first and sampled(4) != first


@pytest.mark.parametrize("fails", ["build", "launch"])
def test_the_demo_closes_its_engine_however_it_ends(monkeypatch, tmp_path, fails):
    """An app that does not start, or a Ctrl-C while serving: the engine (``--backend vllm``) is shut down."""
    pytest.importorskip("gradio")
    import demo.app

    closed = []
    engine = type("Engine", (), {"close": lambda self: closed.append(True)})()
    monkeypatch.setattr(demo.app, "load", lambda args: demo.app.Served(None, tmp_path, "", [], backend=engine))

    class App:
        def queue(self, **kwargs):
            pass

        def launch(self, **kwargs):
            raise KeyboardInterrupt

    def build(served):
        if fails == "build":
            raise RuntimeError("the page did not build")
        return App()

    monkeypatch.setattr(demo.app, "build_app", build)
    with pytest.raises(RuntimeError if fails == "build" else KeyboardInterrupt):
        demo.app.main(["--runs", str(tmp_path)])
    assert closed == [True]
