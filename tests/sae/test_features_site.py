"""The latents' site (sae/features/site.py and web/) in a real browser: headless chromium under selenium, opened
from file://, sorted, searched, a latent opened and its top context's text and highlight checked against the
records it was written from; a 16k-latent SAE opening without its blocks; token strings that try to be HTML;
the local server and the demo's PNG. A screenshot of a latent page is kept in test-artifacts/."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
import urllib.request
import weakref
from pathlib import Path

import numpy as np
import pytest
from browser import chrome, require

from harvest.errors import UserError
from harvest.sae.features import screenshot
from harvest.sae.features.record import Bin, Context, FeaturesRecord, Latent, TensorSummary
from harvest.sae.features.serve import serve
from harvest.sae.features.site import SiteWriter, script, short
from harvest.sae.features.writer import BLOCK
from harvest.storage.storage import Storage

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
VOCAB = [" the", " cat", " sat", "Hello", "\n", "\t", " dog", "ing", " Paris", " é", "42", " mat", " on", "."]
PAGE = 100  # index rows a page (web/app.js)
TOP_TOKENS = 5


@dataclasses.dataclass
class Site:
    """A written site and what it was written from."""

    dir: Path
    record: FeaturesRecord
    latents: dict[str, list[Latent]]


def context(rng, value: float, window: int = 4, vocab=VOCAB) -> Context:
    tokens = [str(t) for t in rng.choice(vocab, 2 * window + 1)]
    acts = rng.uniform(0, value, len(tokens)) * (rng.random(len(tokens)) < 0.6)
    acts[window] = value
    return Context(tokens, [float(a) for a in acts], window, float(value), (0, int(rng.integers(9)), int(rng.integers(10**6))))


def latent(rng, index: int, count: int, tokens: int, top: int = 5, bins: int = 3, vocab=VOCAB) -> Latent:
    if count == 0:
        return Latent(index, 0, 0.0, 0.0, 0.0, [], [], [], [], [], [])
    values = np.sort(rng.uniform(0.5, 10.0, min(count, top)))[::-1]
    edges = np.linspace(0, values[0], bins + 1)
    return Latent(index, count, count / tokens, float(values[0]), float(rng.uniform(0.1, values[-1])),
                  [context(rng, v, vocab=vocab) for v in values],
                  [Bin(float(lo), float(hi), [context(rng, rng.uniform(lo, hi), vocab=vocab) for _ in range(2)])
                   for lo, hi in zip(edges[:-1], edges[1:])],
                  [float(e) for e in np.linspace(0, values[0], 11)], [int(c) for c in rng.integers(0, 50, 10)],
                  [(str(t), float(v)) for t, v in zip(rng.choice(vocab, 5), np.sort(rng.uniform(1, 5, 5))[::-1])],
                  [(str(t), float(v)) for t, v in zip(rng.choice(vocab, 5), np.sort(rng.uniform(-5, -1, 5)))])


def summary(tensor: str, latents: list[Latent], tokens: int, dense_above: float = 0.1) -> TensorSummary:
    return TensorSummary(tensor, len(latents), tokens, sum(x.count == 0 for x in latents),
                         sum(x.density > dense_above for x in latents), dense_above, "topk", 64)


def write(root: Path, latents: dict[str, list[Latent]], tokens: int) -> Site:
    record = FeaturesRecord("synthetic-sae", 0, ["synthetic-run"], [[0]], None, {"top": 5, "window": 4},
                            [summary(t, xs, tokens) for t, xs in latents.items()])
    writer = SiteWriter(Storage(str(root)), record)
    for tensor, xs in latents.items():
        for start in range(0, len(xs), BLOCK):
            writer.add(tensor, xs[start:start + BLOCK])
    writer.close()
    return Site(root, record, latents)


def synthetic(rng, n: int, tokens: int) -> list[Latent]:
    """n latents, every 17th dead and every 13th dense (> 0.1 of the tokens)."""
    counts = [0 if i % 17 == 5 else int(rng.integers(tokens // 5, tokens // 2)) if i % 13 == 3
              else int(rng.integers(1, tokens // 20)) for i in range(n)]
    return [latent(rng, i, c, tokens) for i, c in enumerate(counts)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    """The site under test and its records: seeded synthetic latents (two tensors, 3.5 blocks and a part one)."""
    rng = np.random.default_rng(0)
    return write(tmp_path_factory.mktemp("site"), {"resid_post.3": synthetic(rng, 230, 5000),
                                                     "resid_post.5": synthetic(rng, 40, 5000)}, 5000)


@pytest.fixture(scope="module")
def real_site(straight, tmp_path_factory) -> Site:
    """The site `harvest sae features` writes for the SAE tests' straight run (its held-out stream), and the
    records the pass computed (equal to numpy's brute force: test_features_exact.py)."""
    from features_helpers import build_features

    out, record, latents = build_features(straight, tmp_path_factory.mktemp("real-site") / "out", batch_tokens=96)
    return Site(out, record, latents)


@pytest.fixture(scope="module")
def driver():
    d = chrome()
    yield d
    d.quit()


def shown(token: str) -> str:
    """How the page shows a token: control characters as symbols, a newline as ↵."""
    return token.translate({**{c: 0x2400 + c for c in range(32)}, 10: "↵", 9: "⇥", 127: "␡"})


def top_tokens(x: Latent) -> list[str]:
    return list(dict.fromkeys(c.tokens[c.at] for c in x.top))[:TOP_TOKENS]


def js(d, script: str, *args):
    return d.execute_script(script, *args)


def wait(d, selector: str, seconds: float = 15.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if js(d, "return document.querySelector(arguments[0]) !== null", selector):
            return
        time.sleep(0.05)
    error = js(d, "const e = document.querySelector('.error'); return e && e.textContent")
    raise AssertionError(f"{selector} not shown in {seconds} s (page error: {error})")


def open_page(d, root: Path, route: str, selector: str) -> None:
    """A fresh load of the site at `route` (the index's sort and search start over)."""
    d.get("about:blank")
    d.get(f"{(root / 'index.html').as_uri()}#/{route}")
    wait(d, selector)


def shown_ids(d) -> list[int]:
    return js(d, "return [...document.querySelectorAll('#latents tbody tr')].map(r => +r.dataset.latent)")


def click(d, selector: str) -> None:
    js(d, "document.querySelector(arguments[0]).click()", selector)


def loaded(d) -> list[str]:
    return js(d, "return [...document.querySelectorAll('script[data-harvest]')].map(s => s.dataset.harvest)")


def no_errors(d) -> None:
    """Nothing went wrong in the page since the last look: no script error, no load refused by its CSP."""
    assert [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"] == []


def expected_order(xs: list[Latent], key: str, desc: bool) -> list[int]:
    sign = -1 if desc else 1
    return [x.index for x in sorted(xs, key=lambda x: (sign * short(getattr(x, key)), x.index))]


def test_data_files_are_scripts_of_the_records(site):
    tensor = site.record.tensors[0].tensor
    xs = site.latents[tensor]
    for name in ("index.html", "app.js", "style.css", "data/site.js"):
        assert (site.dir / name).is_file(), name
    blocks = sorted((site.dir / "data" / tensor).glob("block_*.js"))
    assert len(blocks) == -(-len(xs) // BLOCK)
    text = blocks[-1].read_text(encoding="utf-8")
    path, data = re.fullmatch(r'harvestRegister\(("[^"]*"),(.*)\);\n', text, re.S).groups()
    assert json.loads(path) == f"data/{tensor}/{blocks[-1].name}"
    assert [Latent.from_json(x).index for x in json.loads(data)] == [x.index for x in xs[len(blocks) * BLOCK - BLOCK:]]
    index = json.loads(re.fullmatch(r'harvestRegister\("[^"]*",(.*)\);\n', (site.dir / "data" / tensor / "index.js")
                                    .read_text(encoding="utf-8"), re.S).group(1))
    assert index["count"] == [x.count for x in xs]
    assert index["max"] == pytest.approx([x.max for x in xs], rel=1e-5)
    assert index["top"] == [top_tokens(x) for x in xs]


def test_data_scripts_keep_any_string_inside_their_json():
    strings = ["</script><script>alert(1)</script>", "\u2028\u2029", "\ud800 lone", "é\n\t\"'\\", "<!--"]
    text = script("data/t/block_0000.js", strings).decode("utf-8")
    assert "</" not in text and not any(c in text for c in "\u2028\u2029\ud800")
    assert json.loads(re.fullmatch(r'harvestRegister\("[^"]*",(.*)\);\n', text, re.S).group(1)) == strings


def test_writer_refuses_blocks_out_of_order_and_a_short_close(tmp_path):
    rng = np.random.default_rng(1)
    xs = synthetic(rng, 70, 1000)
    writer = SiteWriter(Storage(str(tmp_path)), FeaturesRecord("s", 0, ["r"], [[0]], None, {}, [summary("t", xs, 1000)]))
    with pytest.raises(ValueError, match="expected a block of latents 0"):
        writer.add("t", xs[1:65])
    with pytest.raises(ValueError, match="not in the record"):
        writer.add("u", xs[:64])
    block = xs[:64]
    writer.add("t", block)
    with pytest.raises(ValueError, match="64 of its 70 latents"):
        writer.close()
    kept = weakref.ref(block[0])
    del block, xs
    assert kept() is None, "the writer keeps index rows, not the latents it was given"


def test_index_sorts_by_density_and_max(site, driver):
    for tensor, xs in site.latents.items():
        open_page(driver, site.dir, tensor, "#latents tbody tr")
        assert shown_ids(driver) == list(range(min(PAGE, len(xs))))
        for key in ("density", "max", "mean"):
            for desc in (True, False):  # the first click sorts largest first, the second smallest first
                click(driver, f"button.sort[data-key={key}]")
                assert shown_ids(driver) == expected_order(xs, key, desc)[:PAGE], (tensor, key, desc)
        if len(xs) > PAGE:
            click(driver, "button.next")
            assert shown_ids(driver) == expected_order(xs, "mean", False)[PAGE:2 * PAGE]


def test_search_by_top_token(site, driver):
    tensor = site.record.tensors[0].tensor
    xs = site.latents[tensor]
    word = next(t.strip() for x in xs for t in top_tokens(x) if len(t.strip()) >= 2 and t.strip().isalpha())
    query = word[1:].upper()
    expected = [x.index for x in xs if any(query.lower() in t.lower() for t in top_tokens(x))]
    open_page(driver, site.dir, tensor, "#search")
    driver.find_element("css selector", "#search").send_keys(query)
    assert shown_ids(driver) == expected[:PAGE]
    assert f"of {len(expected):,} " in js(driver, "return document.querySelector('.pager .status').textContent")
    tops = js(driver, "return [...document.querySelectorAll('#latents tbody td.tokens')].map(td => td.textContent)")
    assert all(query.lower() in t.lower() for t in tops)


def test_dead_and_dense_are_marked(site, driver):
    tensor = site.record.tensors[0].tensor
    xs = site.latents[tensor]
    dense_above = site.record.tensors[0].dense_above
    open_page(driver, site.dir, tensor, "#latents tbody tr")
    for _ in range(2):  # smallest density first (the dead), then largest (the dense)
        click(driver, "button.sort[data-key=density]")
        rows = js(driver, "return [...document.querySelectorAll('#latents tbody tr')].map(r => "
                          "[+r.dataset.latent, r.className, r.querySelector('td.flags').textContent])")
        for i, cls, flag in rows:
            dead, dense = xs[i].count == 0, xs[i].density > dense_above
            assert ("dead" in cls.split(), "dense" in cls.split()) == (dead, dense), i
            assert flag == ("dead" if dead else "dense" if dense else "")


def alpha(colour: str) -> float:
    parts = re.findall(r"[\d.]+", colour)
    return float(parts[3]) if len(parts) == 4 else 1.0 if colour.startswith("rgb(") else 0.0


@pytest.mark.parametrize("made", ["site", "real_site"])
def test_latent_page_shows_the_records(made, request, driver):
    site = request.getfixturevalue(made)
    tensor = site.record.tensors[0].tensor
    xs = site.latents[tensor]
    x = max((x for x in xs if x.top), key=lambda x: len(set(x.top[0].acts)))
    top = x.top[0]
    open_page(driver, site.dir, f"{tensor}/{x.index}", "ol.top-examples li")
    spans = js(driver, "return [...document.querySelector('ol.top-examples .context').children].map(s => "
                       "[s.textContent, s.className, s.title, getComputedStyle(s).backgroundColor])")
    assert "".join(text for text, *_ in spans) == "".join(shown(t) for t in top.tokens)
    assert [i for i, (_, cls, *_) in enumerate(spans) if "at" in cls.split()] == [top.at]
    assert spans[top.at][0] == shown(top.tokens[top.at])
    assert float(spans[top.at][2].split()[-1]) == pytest.approx(top.value, rel=1e-3)
    alphas = [alpha(colour) for *_, colour in spans]
    for j, act in enumerate(top.acts):
        assert alphas[j] == pytest.approx(min(1, act / x.max), abs=0.01), (j, act, spans[j])
    by_act = [alphas[j] for j in np.argsort(top.acts, kind="stable")]
    assert by_act == sorted(by_act)
    assert js(driver, "return document.querySelectorAll('ol.top-examples > li').length") == len(x.top)
    heights = js(driver, "return [...document.querySelectorAll('svg.histogram rect.hbar')].map(r => +r.getAttribute('height'))")
    assert len(heights) == len(x.counts)
    assert np.allclose(np.array(heights) / max(heights), np.array(x.counts) / max(x.counts), atol=1e-3)
    for cls, pairs in (("top-logits", x.top_logits), ("bottom-logits", x.bottom_logits)):
        rows = js(driver, f"return [...document.querySelectorAll('table.{cls} tbody tr')].map(r => "
                          "[r.cells[0].textContent, +r.cells[1].textContent])")
        assert [t for t, _ in rows] == [shown(t) for t, _ in pairs]
        assert [v for _, v in rows] == pytest.approx([v for _, v in pairs], rel=1e-3)
    assert js(driver, "return document.querySelectorAll('section.bin').length") == len(x.bins)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"features-latent-{made}.png"
    driver.save_screenshot(str(shot))
    print(f"screenshot of latent {x.index}'s page: {shot}")
    nxt = x.index + 1 if x.index + 1 < len(xs) else x.index - 1
    click(driver, "a.next" if nxt > x.index else "a.prev")
    wait(driver, f"a.back[href='#/{tensor}']")
    assert js(driver, "return document.querySelector('h1').textContent").startswith(f"Latent {nxt}")
    dead = next((x for x in xs if x.count == 0), None)
    if dead is not None:
        open_page(driver, site.dir, f"{tensor}/{dead.index}", "h1 .flag.dead")
    no_errors(driver)


def test_sixteen_thousand_latents_open_at_once(tmp_path, driver):
    rng = np.random.default_rng(2)
    n, tokens = 16384, 10**6
    counts = rng.integers(0, 2000, n)
    xs = [Latent(i, int(c), int(c) / tokens, float(m), float(m) / 2, [context(rng, float(m), window=1)] if c else [],
                 [], [0.0, float(m) / 2, float(m)], [int(c) // 2, int(c) - int(c) // 2], [], [])
          for i, (c, m) in enumerate(zip(counts, rng.uniform(0.1, 20, n)))]
    root = write(tmp_path, {"big": xs}, tokens).dir
    per_latent = (root / "data" / "big" / "index.js").stat().st_size / n
    print(f"index.js: {per_latent:.0f} bytes a latent")
    assert per_latent < 100
    start = time.monotonic()
    open_page(driver, root, "big", "#latents tbody tr")
    print(f"16,384-latent index shown in {time.monotonic() - start:.2f} s")
    assert shown_ids(driver) == list(range(PAGE))
    assert sorted(loaded(driver)) == ["data/big/index.js", "data/site.js"]
    click(driver, "button.sort[data-key=max]")
    assert shown_ids(driver) == expected_order(xs, "max", True)[:PAGE]
    js(driver, "location.hash = '#/big/16000'")
    wait(driver, "a.back")
    assert [p for p in loaded(driver) if "block_" in p] == ["data/big/block_0250.js"]
    assert js(driver, "return document.querySelector('h1').textContent").startswith("Latent 16000")


def test_token_strings_render_as_text(tmp_path, driver):
    hostile = ["<img src=x onerror=alert(1)>", "</script>", "<b>bold</b>", "\u2028", "&amp;", "\"'`${x}"]
    rng = np.random.default_rng(3)
    xs = [latent(rng, i, 40, 1000, vocab=hostile) for i in range(3)]
    root = write(tmp_path, {"t": xs}, 1000).dir
    data = (root / "data" / "t" / "block_0000.js").read_text(encoding="utf-8")
    assert "</script>" not in data and "\u2028" not in data and "\u2029" not in data
    open_page(driver, root, "t", "#latents tbody tr")
    assert js(driver, "return [...document.querySelectorAll('#latents td.tokens')].map(td => td.textContent)") == \
        ["".join(top_tokens(x)) for x in xs]
    open_page(driver, root, "t/0", "ol.top-examples li")
    texts = js(driver, "return [...document.querySelectorAll('ol.top-examples .context')].map(c => c.textContent)")
    assert texts == ["".join(c.tokens) for c in xs[0].top]
    assert js(driver, "return document.querySelectorAll('img, b, script:not([src])').length") == 0
    no_errors(driver)


def test_serve_answers_the_site_over_http(site, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threading.Thread(target=serve, args=(str(site.dir), port), daemon=True).start()
    url = f"http://127.0.0.1:{port}/"
    end = time.monotonic() + 10
    while True:
        try:
            page = urllib.request.urlopen(url + "index.html", timeout=5).read()
            break
        except OSError:
            assert time.monotonic() < end, f"serve() did not answer on {url}"
            time.sleep(0.05)
    assert page == (site.dir / "index.html").read_bytes()
    tensor = site.record.tensors[0].tensor
    assert urllib.request.urlopen(f"{url}data/{tensor}/index.js", timeout=5).read() == \
        (site.dir / "data" / tensor / "index.js").read_bytes()
    assert url in capsys.readouterr().out
    with pytest.raises(UserError, match="no index.html"):
        serve(str(site.dir / "data"), port)


def test_screenshot_png(site, tmp_path):
    if screenshot.browser() is None:
        require()
    tensor = site.record.tensors[0].tensor
    x = next(x for x in site.latents[tensor] if x.top)
    out = screenshot.png(site.dir, tensor, x.index, tmp_path / "latent.png", width=900, height=700)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (900, 700)
