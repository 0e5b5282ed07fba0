"""`lmstack webui` in a real headless Chromium (Debian's chromium + chromedriver, driven by selenium), on
loopback, against the tiny model: the form filled for a LoRA SFT, Preview data, Plan, Start, live
progress and the loss plot advancing, Stop (SIGTERM, exit 143), Resume to the end, chat with the
result, export it; an LF YAML loaded and saved back equal in meaning; the language switch; a login
refused and accepted; a non-loopback bind without a login refused.

The screenshots under docs/webui/ come from this test: it saves them into the pytest base temp folder
(`webui-screens/`; run with `--basetemp DIR` to keep them) and they are copied from there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from lmstack.config.load import build_config

selenium = pytest.importorskip("selenium")
pytest.importorskip("gradio")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1600",
    # nothing but this machine's loopback UI is ever looked up
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1, EXCLUDE 127.0.0.2",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_webui(tmp: Path, host: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port(host)
    log = tmp / f"webui-{host}-{port}.log"
    cmd = [sys.executable, "-m", "lmstack.cli", "webui", "--host", host, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 90
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with socket.create_connection((host, port), timeout=1):
                return proc, f"http://{host}:{port}/", log
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"the web UI did not come up:\n{log.read_text()[-3000:]}")


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


class Page:
    """A browser on the web UI, addressed by the elem_ids the UI gives its widgets."""

    def __init__(self, driver: webdriver.Chrome, shots: Path):
        self.d, self.shots = driver, shots

    def open(self, url: str) -> None:
        self.d.get(url)
        self.wait(lambda: self.d.find_elements(By.ID, "btn-start"), 60, "the page to load")

    def wait(self, ok, timeout: float = 30, what: str = "", poll: float = 0.2):
        deadline = time.time() + timeout
        while True:
            try:
                got = ok()
            except Exception:  # an element re-rendered under us: look again
                got = None
            if got:
                return got
            if time.time() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(poll)

    def css(self, selector: str):
        return self.wait(lambda: self.d.find_element(By.CSS_SELECTOR, selector), 30, selector)

    def click(self, elem_id: str) -> None:
        el = self.css(f"#{elem_id}")
        self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
        self.press(el, elem_id)

    def press(self, el, what: str) -> None:
        """Clicks `el` once nothing covers it (Gradio's loading overlay intercepts clicks meanwhile)."""
        self.wait(lambda: el.click() or True, 30, f"{what} to take a click")

    def tab(self, name: str) -> None:
        self.click(f"tab-{name}-button")

    def type(self, name: str, text: object) -> None:
        box = self.css(f"#f-{name} input, #f-{name} textarea")
        self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
        self.press(box, name)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.BACKSPACE)
        box.send_keys(str(text))
        box.send_keys(Keys.TAB)

    def pick(self, name: str, value: str) -> None:
        """Choose `value` in the dropdown of field `name` (its option label starts with the value)."""
        box = self.css(f"#f-{name} input[role=combobox]")
        self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
        self.press(box, name)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.BACKSPACE)
        box.send_keys(value)

        def option():
            for li in self.d.find_elements(By.CSS_SELECTOR, "ul[role=listbox] li[role=option]"):
                if (li.get_attribute("aria-label") or "").startswith(value):
                    return li
            return None

        self.wait(option, 10, f"option {value} of {name}").click()
        box.send_keys(Keys.ESCAPE)

    def text(self, elem_id: str) -> str:
        return self.css(f"#{elem_id}").text

    def value(self, elem_id: str) -> str:
        return self.css(f"#{elem_id} textarea, #{elem_id} input").get_attribute("value") or ""

    def wait_text(self, elem_id: str, needle: str, timeout: float = 60) -> str:
        return self.wait(
            lambda: needle in self.text(elem_id) and self.text(elem_id), timeout, f"{needle!r} in #{elem_id}"
        )

    def shot(self, name: str) -> None:
        """A full-page PNG (DevTools' capture beyond the viewport)."""
        import base64

        self.shots.mkdir(parents=True, exist_ok=True)
        size = self.d.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        png = self.d.execute_cdp_cmd(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            },
        )
        (self.shots / f"{name}.png").write_bytes(base64.b64decode(png["data"]))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield Page(driver, tmp_path_factory.getbasetemp() / "webui-screens")
    driver.quit()


@pytest.fixture(scope="module")
def webui(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("webui")
    proc, url, log = start_webui(tmp, "127.0.0.1", "--share-dir", str(tmp / "share"))
    yield url, tmp, log
    stop_process(proc)


# long enough that Stop lands mid-run on an idle machine too (the tiny model runs ~70 steps/s there),
# short enough to resume to the end within the test's waits on a loaded one (~3 steps/s)
STEPS = 300


def fill_lora_sft(page: Page, model: Path, out: Path) -> None:
    page.type("model_name_or_path", model)
    page.pick("template", "qwen")
    page.type("dataset_dir", DATA_DIR)
    page.pick("dataset", "alpaca_en_demo")
    page.type("output_dir", out)
    page.type("max_steps", STEPS)
    page.type("per_device_train_batch_size", 2)
    page.type("cutoff_len", 128)
    page.type("learning_rate", "1e-2")
    page.type("logging_steps", 1)
    page.type("save_steps", 10)


def points(page: Page) -> int:
    return int(page.text("run-status").split(" loss points")[0].split()[-1])


def preview_and_plan(page: Page) -> None:
    page.click("btn-preview-yaml")
    shown = yaml.safe_load(page.wait(lambda: page.value("train-out"), 30, "the YAML"))
    assert (
        shown["dataset"] == "alpaca_en_demo" and shown["max_steps"] == STEPS and shown["template"] == "qwen"
    )
    assert shown["learning_rate"] == 0.01 and "stage" not in shown  # defaults are left to the schema
    page.click("btn-preview-data")
    report = page.wait(
        lambda: "trainable tokens" in page.value("train-out") and page.value("train-out"), 90, "report"
    )
    assert "alpaca_en_demo (dataset): 60 records, 60 kept, 0 dropped" in report
    assert page.css("#train-example .lm-trained").text.strip()  # the answer tokens, marked as trained
    page.shot("data_preview")
    page.click("btn-plan")
    table = page.wait(
        lambda: "recommendation" in page.value("train-out") and page.value("train-out"), 60, "plan"
    )
    assert "single" in table and "run plan" in table
    box = page.css("#train-out textarea")  # the plan's columns stay aligned: no wrapping in the box
    assert page.d.execute_script("return getComputedStyle(arguments[0]).whiteSpace", box) == "pre"
    page.click("btn-apply")
    assert "gradient_checkpointing: false" in page.wait_text("train-msg", "Applied")
    page.click("btn-preview-yaml")
    page.wait(
        lambda: "gradient_checkpointing: false" in page.value("train-out"), 30, "the applied plan in the YAML"
    )
    page.shot("train")


def start_stop_resume(page: Page, url: str, out: Path, share: Path) -> None:
    page.click("btn-start")  # switches to the Runs tab
    first = int(page.wait_text("run-status", "loss points", 120) and points(page))
    page.wait(
        lambda: points(page) > first, 150, "the loss plot to get more points"
    )  # a loaded 2-core box is slow
    # the speed needs a second of the run's own elapsed_time between two log points: wait for it
    status = page.wait_text("run-status", "tokens/s", 150)
    assert "running" in status and f"/{STEPS}" in status and "ETA" in status, status
    page.click("btn-stop")
    page.wait_text("runs-msg", "SIGTERM")
    status = page.wait_text("run-status", "exit code 143", 120)
    assert "stopped" in status and f"step {STEPS}/{STEPS}" not in status, status
    stopped_at = int(status.split("step ")[1].split("/")[0])
    assert (out / f"checkpoint-{stopped_at}").is_dir()
    page.open(url)  # a new page: the run is found on disk, selected, with its progress
    page.tab("runs")
    assert f"step {stopped_at}/{STEPS}" in page.wait_text("run-status", "exit code 143", 30)
    assert page.value("run") == str(out)
    page.click("btn-resume")
    # a guard only: a loaded 2-core box ran 2.3 s a step, 11 min for what takes 4 s idle
    status = page.wait_text("run-status", "exit code 0", 1800)
    assert (
        "finished" in status and f"step {STEPS}/{STEPS}" in status and points(page) >= STEPS - stopped_at
    ), status
    (train_log,) = (share / "runs").glob("*/train.log")  # both starts, as the UI logged them
    assert f"resume_from_checkpoint: auto -> {out / f'checkpoint-{stopped_at}'}" in train_log.read_text()
    assert (out / "adapter_model.safetensors").is_file()
    page.shot("runs")
    page.click("btn-to-form")  # the reopened page's form is empty: take the run's own YAML
    page.wait_text("runs-msg", "fields set")
    assert page.value("f-output_dir") == str(out)


def chat_and_export(page: Page, model: Path, out: Path, export_dir: Path) -> None:
    page.tab("chat")
    page.click("btn-chat-load")
    assert f"{model} + {out}" in page.wait_text("chat-status", "Loaded", 90)  # base + the trained adapter
    page.type("max_new_tokens", 8)
    page.css("#chat-msg textarea, #chat-msg input").send_keys("Hello")
    page.click("btn-send")
    messages = "#chatbot .message"
    page.wait(lambda: len(page.d.find_elements(By.CSS_SELECTOR, messages)) >= 2, 60, "a reply")
    page.wait(lambda: page.d.find_elements(By.CSS_SELECTOR, messages)[-1].text.strip(), 60, "reply text")
    page.shot("chat")
    page.click("btn-clear")
    page.wait(lambda: not page.d.find_elements(By.CSS_SELECTOR, messages), 20, "a cleared chat")
    page.tab("export")
    page.type("export_dir", export_dir)
    page.click("btn-export")
    page.wait(lambda: "exported to" in page.value("export-out"), 120, "the export")
    assert (export_dir / "model.safetensors").is_file() and (export_dir / "Modelfile").is_file()
    page.shot("export")


def test_lora_sft_start_stop_resume_chat_export(browser: Page, webui, tiny_model):
    url, tmp, _ = webui
    out = tmp / "saves" / "tiny-lora"
    browser.open(url)
    fill_lora_sft(browser, tiny_model, out)
    preview_and_plan(browser)
    start_stop_resume(browser, url, out, tmp / "share")
    chat_and_export(browser, tiny_model, out, tmp / "exported")


LF_YAML = """\
### model
model_name_or_path: {model}
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
dataset_dir: {data}
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
save_strategy: no
"""


def test_lf_yaml_loads_and_saves_back_equal_in_meaning(browser: Page, webui, tiny_model):
    url, tmp, _ = webui
    source, saved = tmp / "lf.yaml", tmp / "saved" / "lf_again.yaml"
    source.write_text(LF_YAML.format(model=tiny_model, data=DATA_DIR))
    page = browser
    page.open(url)
    page.type("lora_rank", 4)  # a value the loaded file replaces
    page.css("#yaml-path textarea, #yaml-path input").send_keys(str(source))
    page.click("btn-load")
    page.wait_text("train-msg", "fields set")
    assert page.value("f-lora_rank") == "8" and page.value("f-learning_rate") == "0.0001"
    page.css("#yaml-path textarea, #yaml-path input").send_keys(Keys.CONTROL, "a")
    page.css("#yaml-path textarea, #yaml-path input").send_keys(str(saved))
    page.click("btn-save")
    page.wait_text("train-msg", "Saved")
    original, again = yaml.safe_load(source.read_text()), yaml.safe_load(saved.read_text())
    assert build_config(original) == build_config(again)
    assert list(again) == list(original)  # every key kept, in the file's order, nothing added
    page.type("lora_rank", 4)
    page.css("#btn-upload input[type=file], input[type=file]").send_keys(str(saved))  # the upload path
    page.wait(lambda: page.value("f-lora_rank") == "8", 30, "the uploaded YAML in the form")

    page.click("lang")  # the radio group: pick 中文
    page.d.find_element(By.XPATH, "//label[contains(., '中文')]").click()
    page.wait(lambda: page.css("#tab-train-button").text == "训练", 20, "the Chinese tab names")
    assert "训练" in page.text("tab-train-button") and "开始" in page.text("btn-start")
    page.shot("train_zh")
    page.d.find_element(By.XPATH, "//label[contains(., 'English')]").click()
    page.wait(lambda: page.css("#tab-train-button").text == "Train", 20, "the English tab names")


def test_login_refused_then_accepted_and_open_bind_without_login_refused(browser: Page, tmp_path):
    refused = subprocess.run(
        [sys.executable, "-m", "lmstack.cli", "webui", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "--auth" in refused.stderr and "0.0.0.0" in refused.stderr
    (tmp_path / "users").write_text("# who may log in\nalice:s3cret\n")
    proc, url, log = start_webui(tmp_path, "127.0.0.2", "--auth-file", str(tmp_path / "users"))
    try:
        page = browser
        page.d.get(url)
        for password, welcome in (("wrong", False), ("s3cret", True)):
            user = page.css("input[type=text], input[name=username]")
            user.clear()
            user.send_keys("alice")
            secret = page.css("input[type=password]")
            secret.clear()
            secret.send_keys(password + Keys.ENTER)
            if welcome:
                page.wait(lambda: page.d.find_elements(By.ID, "btn-start"), 60, "the app after login")
            else:
                page.wait(lambda: "incorrect" in page.d.page_source.lower(), 20, "the refusal")
                assert not page.d.find_elements(By.ID, "btn-start")
    finally:
        stop_process(proc)
    shutil.rmtree(tmp_path / "share", ignore_errors=True)
