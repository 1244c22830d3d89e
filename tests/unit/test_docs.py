"""The docs a user reads: every guide stays short, the option reference is the schema's, and every docs path,
link and #anchor that code, scripts, specs, error messages and the docs themselves name exists."""
import glob
import os
import re
import runpy

from conftest import REPO

GUIDE_MAX_LINES = 400
# Trees whose files may name a guide (code, error messages, scripts, specs, benchmarks, tests).
NAMING_TREES = ("msdist", "models", "scripts", "deploy", "benchmarks", "configs", "tests", ".ci")
NAMING_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".sbatch", ".md", "Dockerfile", "run")
SKIPPED_TREE = os.path.join(REPO, "tests", "data")
# `docs/NAME.md` with an optional `#anchor`, as code and messages write it.
_DOCS_PATH = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")
# A Markdown link's target, `[text](target)`, without a scheme (http:, mailto:).
_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _markdown_files():
    return ([os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
            + sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "*.md"))))


def github_anchors(markdown):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens,
    `-1`, `-2`... for repeats; headings inside fenced code are not headings."""
    anchors, seen = set(), {}
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _missing(target_path, anchor, named_in):
    if not os.path.isfile(target_path):
        return f"{named_in}: {os.path.relpath(target_path, REPO)} does not exist"
    if anchor and target_path.endswith(".md") and anchor not in github_anchors(_read(target_path)):
        return f"{named_in}: {os.path.relpath(target_path, REPO)} has no heading for #{anchor}"
    return None


def _naming_files():
    for tree in NAMING_TREES:
        for root, dirs, files in os.walk(os.path.join(REPO, tree)):
            # tests/data holds fixtures written by others (datasets, old checkpoints), not references to guides
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(root, d) != SKIPPED_TREE]
            for name in files:
                if name.endswith(NAMING_SUFFIXES) and name != os.path.basename(__file__):
                    yield os.path.join(root, name)
    yield os.path.join(REPO, "README.md")


def test_the_anchor_rule_is_githubs():
    doc = "# Stall options\n## Elastic jobs: `--nnodes MIN:MAX`\n```\n# not a heading\n```\n## Stall options\n"
    assert github_anchors(doc) == {"stall-options", "elastic-jobs---nnodes-minmax", "stall-options-1"}


def test_every_docs_path_named_in_code_scripts_specs_and_messages_exists():
    problems = []
    for path in _naming_files():
        for name, anchor in _DOCS_PATH.findall(_read(path)):
            problem = _missing(os.path.join(REPO, "docs", name), anchor, os.path.relpath(path, REPO))
            if problem:
                problems.append(problem)
    assert problems == []


def test_every_link_in_the_docs_reaches_its_file_and_heading():
    problems = []
    for path in _markdown_files():
        text = _FENCE.sub("", _read(path))
        for target in _LINK.findall(text):
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            problem = _missing(resolved, anchor, os.path.relpath(path, REPO))
            if problem:
                problems.append(problem)
    assert problems == []


def test_no_guide_is_over_the_size_bound():
    """A guide longer than this is a lab notebook again: measurement histories go to benchmarks/results/."""
    sizes = {os.path.relpath(p, REPO): len(_read(p).splitlines()) for p in _markdown_files()
             if os.sep + "docs" + os.sep in p or p.endswith("README.md")}
    assert {p: n for p, n in sizes.items() if n > GUIDE_MAX_LINES} == {}


def test_the_option_reference_is_generated_from_the_current_schema():
    generator = runpy.run_path(os.path.join(REPO, "scripts", "options_doc.py"))
    assert _read(os.path.join(REPO, "docs", "options.md")) == generator["render"](), \
        "docs/options.md is stale: run python scripts/options_doc.py --write"


def test_the_option_reference_names_every_option():
    from msdist import launch
    from msdist.run import config
    doc = _read(os.path.join(REPO, "docs", "options.md"))
    names = [o.name for o in config.EVAL_OPTIONS] + [s.lstrip("-") for a in launch._build_parser()._actions
                                                      for s in a.option_strings if s not in ("-h", "--help")]
    assert [n for n in names if f"`{n}`" not in doc and f"`-{n}`" not in doc and f"`--{n}`" not in doc] == []
