"""The documents a reader follows: every relative link of the README,
CONTRIBUTING.md and docs/ reaches a file of the repository, and every
``#anchor`` a heading of it (GitHub's rule for heading ids); the README
stays short and keeps the blocks CI runs."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    """The text outside fenced blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's id of a heading: lower case, inline markup and punctuation
    dropped (letters, digits, '_' and '-' kept), spaces made '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    seen: dict = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_follows_github():
    assert slug("The first step runs under a plan (`capture_batch='auto'`)") == \
        "the-first-step-runs-under-a-plan-capture_batchauto"
    assert slug("§7 Baselines and chains") == "7-baselines-and-chains"
    assert slug("On a CUDA machine (CuPy, NumPy 2)") == "on-a-cuda-machine-cupy-numpy-2"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
    broken = []
    for target in LINK.findall(_without_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that id in {dest.name}")
    assert broken == [], f"{doc.name}: {broken}"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines: move details to a page under docs/"


def test_readme_keeps_the_commands_ci_runs():
    """.ci/run's own extraction finds a command after each of its markers."""
    script = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r"^extract\(\) \{.*?^\}", script, flags=re.S | re.M).group(0)
    for marker in ("<!-- ci:setup -->", "<!-- ci:test -->", "<!-- ci:test-numpy2 -->"):
        cmd = subprocess.run(["bash", "-c", f"{extract}\nextract '{marker}'"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        assert cmd.strip(), f"README.md has no command after {marker}"


def _layout() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def test_contributing_layout_names_every_module():
    """Each module and package folder of chainer_recompute is named in
    CONTRIBUTING.md's layout (a new module adds its line there)."""
    layout = _layout()
    missing = []
    for path in sorted((ROOT / "chainer_recompute").rglob("*.py")):
        name = path.parent.name if path.stem in ("__init__", "__main__") else path.stem
        if not re.search(rf"(?<![\w.]){re.escape(name)}\b", layout):
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == [], f"modules CONTRIBUTING.md's layout does not name: {missing}"


def test_contributing_layout_names_only_files_that_exist():
    files = {p.name for d in ("chainer_recompute", "scripts", "tests", "experiments")
             for p in (ROOT / d).rglob("*") if p.is_file()}
    gone = sorted(set(re.findall(r"\b\w+\.(?:py|sh)\b", _layout())) - files)
    assert gone == [], f"CONTRIBUTING.md's layout names files that do not exist: {gone}"
