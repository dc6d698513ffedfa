"""The chat page of `mlx-spec serve`: served at `/` without the key (not with `--no-ui`), and
driven in a real headless Chromium against a live server whose model writes a fixed script
(markup included) forever: the key asked for and kept out of the address, a reply streamed
with its tokens coloured by how they came, the stats line and the acceptance chart, a reply
stopped mid-stream, and markup from the user or the model shown as text."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import mlx_spec
from mlx_spec.cli import build_parser
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories

import httpx
import pytest
import tinymodels as tm
from conftest import serving

KEY = "sk-page"
XSS = '<img src=x onerror="window.__xss=1">'
PIECES = [
    "Hello", " from", " a", " scripted", " model:", " " + XSS, " and", " **bold**",
    " with `code`.", "\n\n", "```python\n", "print", "(", "'hi'", ")", "\n```\n\n",
]  # fmt: skip
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--no-first-run", "--disable-component-update", "--disable-sync", "--window-size=1100,800",
]  # fmt: skip


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    """The script model with itself as its draft model (every draft right) and n-gram lookup
    (right once the script repeats)."""
    path = tm.write_script_checkpoint(tmp_path_factory.mktemp("script") / "model", PIECES)
    model, tok = mlx_spec.load(str(path))
    return model, tok, drafter_factories(model, tok, draft_model=str(path))


def make_app(script, **config):
    model, tok, drafters = script
    settings = dict(model_id="script", default_drafter="all", max_tokens_limit=4000)
    return create_app(model, tok, ServerConfig(**{**settings, **config}), drafters)


@pytest.fixture(scope="module")
def url(script):
    with serving(make_app(script, api_key=KEY)) as base:
        yield base


def test_page_served_without_the_key(url):
    """The page and its files need no key (they hold no data) and forbid other origins'
    scripts; the API still needs the key."""
    page = httpx.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("app.js", "markdown.js", "speculation.js", "style.css"):
        assert httpx.get(f"{url}/ui/{name}").status_code == 200, name
    assert httpx.get(url + "/v1/models").status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/models", headers=headers).status_code == 200


def test_no_ui(script):
    """`--no-ui`: no page, the API as before."""
    args = build_parser().parse_args(["serve", "--no-ui"])
    assert args.no_ui
    with serving(make_app(script, ui=False)) as base:
        assert httpx.get(base + "/").status_code == 404
        assert httpx.get(base + "/ui/app.js").status_code == 404
        assert httpx.get(base + "/v1/models").status_code == 200


def test_wheel_carries_the_page():
    """The page's files are package data (a wheel holds them)."""
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert '"serving/ui/*"' in pyproject
    ui = Path(mlx_spec.__file__).parent / "serving" / "ui"
    assert {p.name for p in ui.iterdir()} >= {"index.html", "app.js", "style.css"}


# ---------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip(
            "no Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="mlx-spec-chromium-")
    for flag in CHROME_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait(driver, condition, seconds: float = 20):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.05).until(condition)


def find(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def find_all(driver, css: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


@pytest.fixture(scope="module")
def page(browser, url):
    """The page, loaded, after it asked for the key and was given it."""
    browser.get(url + "/")
    wait(browser, lambda d: "API key" in find(d, "#notice").text)
    browser.notice_before_key = find(browser, "#notice").text
    key = find(browser, "#api-key")
    key.send_keys(KEY)
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait(browser, lambda d: find(d, "#model").get_attribute("value") == "script")
    return browser


def set_field(driver, css: str, value: str) -> None:
    """Set a setting (an input or a select) as a user would leave it."""
    driver.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('change'));",
        css,
        value,
    )


def ask(driver, text: str, max_tokens: int, drafter: str = "") -> None:
    """Start a new chat and send `text`."""
    find(driver, "#new-chat").click()
    set_field(driver, "#max-tokens", str(max_tokens))
    set_field(driver, "#drafter", drafter)
    find(driver, "#prompt").send_keys(text)
    find(driver, "#send").click()


def done(driver) -> bool:
    return (
        find(driver, "#send").is_displayed() and "tok/s" in find(driver, ".assistant .stats").text
    )


def test_key_asked_and_kept_out_of_the_address(page, url):
    assert "API key" in page.notice_before_key and not find(page, "#notice").is_displayed()
    assert KEY not in page.current_url and page.current_url == url + "/"
    drafters = [o.get_attribute("value") for o in find_all(page, "#drafter option")]
    assert {"off", "ngram", "draft-model", "all"} <= set(drafters)


def test_reply_shows_speculation(page):
    """A reply streams in with its tokens coloured by how they came, the live line, the
    message's stats line and its chart of acceptance by draft position."""
    ask(page, "hi", 120)
    wait(page, done)
    content = find(page, ".assistant .content").text
    assert content.startswith("Hello from a scripted model:")
    kinds = {k: len(find_all(page, f".assistant .tok.{k}")) for k in ("draft", "bonus", "plain")}
    assert kinds["draft"] > 0 and kinds["plain"] > 0, kinds
    live = find(page, "#live").text
    assert "tok/s" in live and "acceptance" in live and "tokens/pass" in live and "×" in live
    assert find_all(page, ".assistant svg.chart rect")
    assert "draft: " in find(page, "#legend").text
    assert find(page, ".assistant pre code").text.startswith("print('hi')")


def test_stop_mid_stream(page, url):
    """Text appears while the reply streams; Stop ends it there and the server drops it."""
    before = httpx.get(url + "/health").json()["cancelled"]
    ask(page, "go on", 4000, drafter="off")
    wait(page, lambda d: d.find_element("css selector", ".assistant .content").text)
    assert find(page, "#stop").is_displayed() and "tok/s" in find(page, "#live").text
    find(page, "#stop").click()
    wait(page, lambda d: find(d, "#send").is_displayed())
    assert find(page, ".assistant .note").text == "stopped"
    assert int(find(page, ".assistant .stats").text.split()[0]) < 4000
    wait(page, lambda d: httpx.get(url + "/health").json()["cancelled"] > before)


def test_markup_is_shown_as_text(page):
    """Markup typed by the user, and written by the model, is shown as text: no element is
    made from it and its handler never runs; the model's Markdown is still rendered."""
    message = XSS + " and **bold**"
    ask(page, message, 30)
    wait(page, done)
    assert find(page, ".user .content").text == message
    assert not find_all(page, "#messages img")
    assert page.execute_script("return window.__xss") is None
    reply = find(page, ".assistant .content")
    assert XSS in reply.text
    bold = [b.text for b in find_all(page, ".assistant strong")]
    assert bold and set(bold) == {"bold"}
