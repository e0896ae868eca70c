"""The site: golden tree, strict HTML, links and anchors, escaping, determinism, scale."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from urllib.parse import urldefrag

import html5lib
import pytest
from bs4 import BeautifulSoup
from jsonschema import Draft202012Validator

from conftest import BENCHMARKS, BUNDLED, GOLDEN, GOLDEN_BUILD, GOLDEN_VERSIONS, REGEN_GOLDEN, SMALL
from ledger import cli
from ledger.storage import store
from ledger.core.models import Detail, Figure, Finding, Gpu, Lora, Measurement, Outcome, Provenance
from ledger.site import filters
from ledger.site.views import ROW_LIMIT
from ledger.site.render import SiteWriter, render_site
from ledger.core.errors import UserError

sys.path.insert(0, str(BENCHMARKS))
from synthetic import synthetic_ledger  # noqa: E402

SECTIONS = ["gpu", "measurements", "cross-gpu", "gpu-rx-7900-xtx", "gpu-rtx-3060-ti", "calibration",
            "calibration-anchor", "calibration-prediction", "probe-vs-real-gap", "rank-cost", "dropout-memory",
            "inference-footprint", "host-ram", "plots", "predictions", "downloads"]


@pytest.fixture(scope="module")
def bundled_site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    assert cli.main(["build", "--ledger", str(BUNDLED), "--out", str(out), "-q"]) == 0
    return out


def parse_strict(path: Path):
    parser = html5lib.HTMLParser(strict=True, namespaceHTMLElements=False)
    return parser.parse(path.read_bytes())


def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_golden_tree(tmp_path, monkeypatch):
    """The golden tree, built with the templates compiled afresh and then from the compiled
    templates the first build kept (``render.TemplateCache``), against its dry-run rows' own
    library versions (whatever this machine has installed)."""
    monkeypatch.setenv("VRAM_LEDGER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VRAM_LEDGER_LIBRARY_VERSIONS", GOLDEN_VERSIONS)
    for run in ("compiled", "from the cache"):
        out = tmp_path / run
        assert cli.main(["build", *GOLDEN_BUILD, "--out", str(out), "-q"]) == 0
        got, want = tree_files(out), tree_files(GOLDEN)
        assert sorted(got) == sorted(want), f"file list changed; regenerate with: {REGEN_GOLDEN}"
        changed = [name for name in got if got[name] != want[name]]
        assert changed == [], f"outputs changed ({run}): {changed}; review, then regenerate with: {REGEN_GOLDEN}"
        assert len(list((tmp_path / "cache" / "templates").glob("*.cache"))) >= 7


def test_build_twice_is_byte_identical(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1790000000")
    assert cli.main(["build", "--ledger", str(SMALL), "--out", str(a), "-q"]) == 0
    assert cli.main(["build", "--ledger", str(SMALL), "--out", str(b), "-q"]) == 0
    assert tree_files(a) == tree_files(b)
    assert "2026-09-21" in (a / "index.html").read_text()
    text = "".join(p.decode("utf-8", "replace") for p in tree_files(a).values())
    assert str(tmp_path) not in text  # no absolute paths


def test_each_model_page_is_light_enough_for_a_phone(bundled_site):
    """A page per model, each at most 200 KB (its stock tables to the model's context; the rest of
    its figures load only when the model is chosen), for every model of the fit table."""
    pages = sorted((bundled_site / "fits").glob("*.html"))
    assert len(pages) >= 25
    heavy = {p.name: p.stat().st_size for p in pages if p.stat().st_size > 200_000}
    assert heavy == {}, heavy


def test_every_page_is_strict_html5(bundled_site):
    for page in ("index.html", "estimators.html"):
        parse_strict(bundled_site / page)  # raises ParseError on any error


def _ids_and_links(page: Path):
    doc = parse_strict(page)
    ids = {el.get("id") for el in doc.iter() if el.get("id")}
    links = [el.get("href") for el in doc.iter("a") if el.get("href")]
    srcs = [el.get("src") for el in doc.iter("img") if el.get("src")]
    return ids, links, srcs


def check_links(site: Path) -> int:
    checked = 0
    for page in [site / "index.html", site / "estimators.html"]:
        ids, links, srcs = _ids_and_links(page)
        for href in links + srcs:
            assert not re.match(r"^[a-z]+:", href), f"{page.name}: external or scripted link {href}"
            target, frag = urldefrag(href)
            target_path = (page.parent / target).resolve() if target else page
            assert target_path.is_file(), f"{page.name}: {href} points to a missing file"
            if frag:
                target_ids = ids if target_path == page else _ids_and_links(target_path)[0]
                assert frag in target_ids, f"{page.name}: {href} points to a missing anchor"
            checked += 1
    return checked


def test_internal_links_and_anchors_resolve(bundled_site):
    assert check_links(bundled_site) > 50


def test_sections_and_ids_are_on_both_pages(bundled_site):
    ids, _, _ = _ids_and_links(bundled_site / "index.html")
    md = (bundled_site / "vram.md").read_text(encoding="utf-8")
    # In Markdown every section is a heading (renderers give it an id from its text) and no raw
    # HTML anchor is left for a renderer to show as text or drop.
    headings = {line for line in md.splitlines() if line.startswith("#")}
    assert "<a id=" not in md
    for section in SECTIONS:
        assert section in ids, f"index.html lacks #{section}"
    for heading in ("## Downloads", "## GPU", "## Measurements", "## Cross-GPU probes", "## Plots", "## Predictions",
                    "### AMD Radeon RX 7900 XTX", "### NVIDIA GeForce RTX 3060 Ti", "## Calibration", "### Anchor"):
        assert heading in headings, f"vram.md lacks {heading!r}"
    ledger = store.load(BUNDLED)
    for m in ledger.measurements:
        assert f"m-{m.id}" in ids
        assert f"`{m.id}`" in md


def test_oom_rows_show_the_message_not_a_peak(bundled_site):
    html = (bundled_site / "index.html").read_text(encoding="utf-8")
    row = re.search(r'<tr id="m-real-v14-run2">(.*?)</tr>', html, re.S).group(1)
    assert "OOM: free 58.0 MiB, allocated 7,147.5 MiB, reserved-unallocated 394.0 MiB" in row
    assert 'class="badge oom"' in row


def test_public_json_validates_against_the_published_schema(bundled_site):
    doc = json.loads((bundled_site / "vram.json").read_text())
    schema = json.loads((bundled_site / "vram.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    errors = list(Draft202012Validator(schema).iter_errors(doc))
    assert errors == []
    assert doc["schema_version"] == 1 and doc["ledger"]["schema_version"] == 1
    plot_ids = {p["id"] for p in doc["derived"]["plots"]}
    assert {"peak-vs-rank-rx-7900-xtx", "peak-vs-seq-len", "probe-vs-real-rtx-3070-ti"} <= plot_ids
    for plot in doc["derived"]["plots"]:
        assert (bundled_site / plot["file"]).is_file() and plot["alt"] and plot["caption"]


def test_plot_marks_ooms_as_exceeded_at_the_card_limit(bundled_site):
    doc = json.loads((bundled_site / "vram.json").read_text())
    plot = next(p for p in doc["derived"]["plots"] if p["id"] == "peak-vs-rank-rtx-3070-ti")
    exceeded = [pt for s in plot["series"] for pt in s["points"] if pt["exceeded"]]
    assert exceeded and all(pt["y"] == pytest.approx(7.65 * 1024) for pt in exceeded)


def test_self_contained(bundled_site):
    html = (bundled_site / "index.html").read_text(encoding="utf-8")
    assert "stylesheet" not in html and "@import" not in html and "http://" not in html.replace("http://www.w3.org", "")
    assert re.search(r"<script[^>]+src=", html) is None


HOSTILE = [
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)">',
    "[click](javascript:alert(1))",
    '"><svg onload=alert(1)>',
    "x" * 5000,
    "ünïcødé ✓ 日本語 \u202e",
]


def hostile_ledger():
    text = " ".join(HOSTILE)
    prov = Provenance(source=" ".join(h for h in HOSTILE if len(h) < 100), notes=HOSTILE)  # a source is one line
    return store.empty_ledger(about=text).model_copy(update=dict(
        gpus={"evil": Gpu(name=HOSTILE[0], os=HOSTILE[1], aliases=[HOSTILE[3]], provenance=prov)},
        measurements=[
            Measurement(id="m1", kind="real", gpu="evil", model=HOSTILE[1], config_text=HOSTILE[2],
                        lora=Lora(rank=8), outcome=Outcome(status="ok", peak_allocated_mib=10.0, result_text=HOSTILE[3]),
                        provenance=prov),
            Measurement(id="m2", kind="probe", gpu="evil", lora=Lora(rank=16), seq_len=100,
                        outcome=Outcome(status="oom", result_text=HOSTILE[0]), provenance=prov),
        ],
        findings=[Finding(id="f1", title=HOSTILE[0], claim=text, details=[Detail(label=HOSTILE[1], text=HOSTILE[2])],
                          figures=[Figure(label=HOSTILE[3], value=1.0, unit=HOSTILE[0])], evidence=["m1"],
                          provenance=prov)],
    ))


def test_hostile_strings_are_never_executable(tmp_path):
    out = tmp_path / "site"
    render_site(hostile_ledger(), out)
    doc = parse_strict(out / "index.html")
    scripts = list(doc.iter("script"))
    # The sort script and the fit picker's; nothing of the ledger's.
    assert len(scripts) == 2 and not any("alert(1)" in (s.text or "") for s in scripts)
    for el in doc.iter():
        for attr, value in el.attrib.items():
            assert not attr.lower().startswith("on"), f"event handler {attr} on <{el.tag}>"
            if attr in ("href", "src"):
                assert not value.strip().lower().startswith(("javascript:", "data:")), value
    assert not any(el.tag in ("img", "svg") and el.get("src") == "x" for el in doc.iter())
    html = (out / "index.html").read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    md = (out / "vram.md").read_text(encoding="utf-8")
    # Rendered by a permissive Markdown renderer (raw HTML on): still no element from ledger text.
    from markdown_it import MarkdownIt

    rendered = MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
    soup = BeautifulSoup(rendered, "html.parser")
    assert not soup.find_all(["script", "iframe", "svg"]) and "alert(1)" in soup.get_text()
    assert all(img["src"].startswith("plots/") for img in soup.find_all("img"))  # only the page's own plots
    assert not any(attr.startswith("on") for el in soup.find_all(True) for attr in el.attrs)


def test_markdown_filter_drops_unsafe_links_and_raw_html():
    assert "<a" not in filters.markdown("[x](javascript:alert(1))")
    assert "<a" not in filters.markdown("[x](data:text/html,hi)")
    assert "<script>" not in filters.markdown("<script>alert(1)</script>")
    assert '<a href="https://example.org">' in filters.markdown("[x](https://example.org)")
    assert '<a href="rel/page.html">' in filters.markdown("[x](rel/page.html)")


def test_unit_filters():
    assert filters.mib(6653) == "6,653.0 MiB"
    assert filters.gib(7833.6) == "7.65 GiB"
    assert filters.pct(4.7) == "4.7%" and filters.signed_pct(-2.47, 2) == "-2.47%"
    assert filters.mib(None) == "" and filters.num(None) == ""
    assert filters.md_cell("a|b\nc<d>") == "a\\|b c\\<d\\>"
    assert filters.md_text("it's [x](javascript:y) & [ok](https://e.org)") == \
        "it's \\[x\\](javascript:y) \\& [ok](https://e.org)"


def test_writer_refuses_paths_outside_and_duplicates(tmp_path):
    w = SiteWriter(tmp_path / "out")
    with pytest.raises(UserError, match="outside"):
        w.write("../escape.txt", "x")
    w.write("a.txt", "x")
    with pytest.raises(UserError, match="same path"):
        w.write("a.txt", "y")
    assert not (tmp_path / "escape.txt").exists()


def test_stale_files_are_removed_and_others_kept(tmp_path):
    out = tmp_path / "site"
    render_site(store.load(BUNDLED), out)
    assert (out / "plots" / "peak-vs-rank-rx-7900-xtx.svg").exists()
    (out / "mine.txt").write_text("not the builder's")
    small = store.load(SMALL)
    assert "rtx-3060-ti" not in small.gpus
    render_site(small, out)
    assert not (out / "plots" / "peak-vs-rank-rtx-3060-ti.svg").exists()
    assert (out / "mine.txt").read_text() == "not the builder's"


def test_large_ledger_shows_a_summary_and_every_row_is_downloadable(tmp_path):
    ledger = synthetic_ledger(ROW_LIMIT * 4)  # three cards: every table is over the limit
    out = tmp_path / "site"
    render_site(ledger, out)
    index = (out / "index.html").read_text(encoding="utf-8")
    assert index.count('<tr id="m-') == 0 and "too many to list here" in index
    assert len(index) < 300_000
    parse_strict(out / "index.html")
    assert check_links(out) > 0
    with (out / "vram.csv").open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == [m.id for m in ledger.measurements]
    doc = json.loads((out / "vram.json").read_text())
    assert len(doc["ledger"]["measurements"]) == len(ledger.measurements)


def test_csv_round_trips_the_figures_of_vram_json(bundled_site):
    doc = json.loads((bundled_site / "vram.json").read_text())
    with (bundled_site / "vram.csv").open(newline="", encoding="utf-8") as fh:
        rows = {r["id"]: r for r in csv.DictReader(fh)}
    assert len(rows) == len(doc["ledger"]["measurements"])
    for m in doc["ledger"]["measurements"]:
        row, outcome = rows[m["id"]], m.get("outcome", {})
        for field in ("peak_allocated_mib", "peak_reserved_mib", "pre_step_mib", "after_load_mib", "step_s"):
            assert (float(row[field]) if row[field] else None) == outcome.get(field)
        assert row["lora_rank"] == (str(m["lora"]["rank"]) if "lora" in m else "")
        assert row["status"] == outcome.get("status", "")


def test_bad_ledger_builds_nothing(tmp_path, capsys):
    out = tmp_path / "site"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["build", "--ledger", str(bad), "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip() == f"{bad}:schema_version: missing or not an integer"
    assert not out.exists()


def test_the_site_has_the_several_gpu_tables_the_picker_and_the_board(bundled_site):
    """Runs on several GPUs: fits.md's and the model pages' tables, the picker's figures keyed by the
    world, vram.json's cells and the estimators page's score of Unsloth Studio's rule."""
    from ledger.answer import worlds

    md = (bundled_site / "fits.md").read_text()
    assert "### llama-3.3-70b on several GPUs, QLoRA (4-bit), stock, plain, fsdp" in md
    assert "| 2 × rtx-4090 |" in md and "### qwen2.5-14b on several GPUs, full fine-tuning, bf16 weights, fsdp" in md
    page = (bundled_site / "fits" / "llama-3.3-70b.html").read_text()
    assert 'id="gpus"' in page and '<select name="gpus">' in page
    data = (bundled_site / "fits" / "llama-3.3-70b.json").read_text()
    assert '"4bit|none|plain|rtx-4090|g2-fsdp"' in data
    assert '"bf16|rtx-4090|g8-fsdp"' in (bundled_site / "fits" / "qwen2.5-14b.json").read_text()
    doc = json.loads((bundled_site / "vram.json").read_text())
    board = doc["derived"]["estimators"]["world"]
    assert board["card"] == "rtx-4090" and len(board["rows"]) >= len(worlds.WORLD_GPUS) * len(worlds.WORLD_LORA_MODELS)
    assert "Several GPUs: Unsloth Studio" in (bundled_site / "estimators.html").read_text()
    cells = doc["derived"]["fits"]["world_cells"]
    assert {c["gpus"] for c in cells} == set(worlds.WORLD_GPUS)
