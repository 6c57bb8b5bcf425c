"""BENCHMARKS.md is written by `make bench` (bench/efficiency.py's template): the committed
file opens with the template's "How to read this" (bench/how_to_read.md, read here as a
file: tests do not import the bench) and carries no wording the template no longer writes,
so the next `make bench` changes figures, not the explanations."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOW_TO_READ = (ROOT / "bench" / "how_to_read.md").read_text()
# bench/efficiency.py NO_GPU_CHECK opens with these words.
NO_GPU_CHECK_START = "not run: this run had no GPU."


def test_benchmarks_md_opens_with_the_templates_how_to_read_this() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    header, rest = text.split("\n\n", 2)[:2], text.split("\n\n", 2)[2]
    assert header[0] == "# Benchmarks"
    assert rest.startswith(HOW_TO_READ + "\n## Machine\n")
    # What a reader needs from it: which figures carry over, which are modelled, MISS.
    for words in ("carry over to a real GPU", "Modelled", "**PASS / MISS.**", "bound"):
        assert words in HOW_TO_READ


def test_benchmarks_md_without_a_gpu_check_says_how_to_get_one() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Real GPU check (`bench/gpu_check.sh`)\n\n", 1)[1]
    if not (ROOT / "bench" / "gpu_check.md").exists():
        assert section.startswith(NO_GPU_CHECK_START)
    for internal in ("was lent", "this session", "machine kind", "machine class", "issue 14"):
        assert internal not in text, internal
