"""The documentation: the MkDocs site (mkdocs.yml, docs/) builds with --strict, offline; the
configuration reference is what the config schema describes; every page is in the navigation;
every relative link of README.md (and its anchor) points at something that exists."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

from services.cli import config_docs
from services.cli.config_docs import DOCS_PAGE, REGENERATE, configuration_page, describe_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _mkdocs_config() -> dict:
    return yaml.safe_load(MKDOCS_YML.read_text())


def _nav_pages(nav) -> list[str]:
    """Every page a nav (a list of `title: page` or `title: [sections]` entries) names."""
    pages = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _anchors(markdown_text: str) -> set[str]:
    """The ids Python-Markdown's toc gives the headings of `markdown_text` (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in markdown_text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            anchors.add(slugify(m.group(1).replace("`", ""), "-"))
    return anchors


def test_the_site_builds_strictly_and_offline(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a nav entry without its page or a page
    without a nav entry is an error (mkdocs.yml's `validation`). Proxies that lead nowhere make
    any attempt to fetch something (fonts, a plugin's assets) fail too."""
    site = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about MkDocs 2.0 (what `mkdocs build` prints says so)
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[var] = "http://127.0.0.1:9"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(MKDOCS_YML),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file() and (site / "configuration" / "index.html").is_file()
    assert "rollout_batch_size" in (site / "configuration" / "index.html").read_text()
    assert (site / "img" / "architecture.svg").is_file()


def test_mkdocs_yml_needs_no_network_and_is_strict():
    cfg = _mkdocs_config()
    assert cfg["docs_dir"] == "docs" and cfg["theme"]["name"] == "material"
    assert cfg["theme"]["font"] is False, "theme.font: false (no Google fonts fetched)"
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in cfg.get("plugins", [])]
    assert not {"privacy", "social", "material/privacy", "material/social"} & set(plugins), plugins
    validation = cfg["validation"]
    assert validation["nav"]["omitted_files"] == validation["nav"]["not_found"] == "warn"
    assert validation["links"]["not_found"] == validation["links"]["anchors"] == "warn"


def test_configuration_page_is_the_generated_one():
    """docs/configuration.md is what the config schema describes: a key added, removed or
    described anew without regenerating the page fails here."""
    assert DOCS_PAGE == DOCS / "configuration.md"
    assert DOCS_PAGE.read_text() == configuration_page(), (
        f"docs/configuration.md is out of date; run `.venv/bin/{REGENERATE}` to regenerate it"
    )


def test_configuration_page_holds_every_key_once():
    page = configuration_page()
    table = describe_config("markdown")
    assert page.startswith("# Configuration reference\n") and page.endswith(table)
    keys = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]
    assert len(keys) == len(set(keys)) > 100
    assert {"rollout_batch_size", "model.path", "reward.rules[].name", "rpc.learner.http_port"} <= set(keys)
    assert "&lt;token>" in table and "<token>" not in table, "a bare <token> would vanish as an HTML tag"


def test_the_docs_option_writes_the_page(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert config_docs.main(["--docs", str(out)]) == 0
    assert out.read_text() == configuration_page()
    assert str(out) in capsys.readouterr().out


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(_mkdocs_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(pages - set(nav)) == [], "pages in docs/ that no nav entry names (orphans)"
    assert sorted(set(nav) - pages) == [], "nav entries without their page"
    assert {
        "index.md",
        "configuration.md",
        "resume.md",
        "speed.md",
        "reward-functions.md",
        "evaluate.md",
        "metrics.md",
        "reward-model.md",
        "rlhf-smollm2.md",
        "architecture.md",
    } <= pages


def test_readme_links_point_at_files_and_headings_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert len(targets) > 20
    missing = []
    for target in targets:
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            missing.append(target)
    assert missing == [], f"README.md links to what does not exist: {missing}"


def test_readme_keeps_the_two_commands():
    """CI runs `make test` (.ci/run); the README says what the two commands are."""
    text = (ROOT / "README.md").read_text()
    assert "make run    # the main job" in text and "make test   # every test" in text
    assert "=== summary (logs in runs/test-logs/) ===" in text
    assert len(text.splitlines()) < 250, "the README is the short way in; the rest goes in docs/"
