"""Write docs/options.md, the option reference, from the schemas themselves: msdist.train's options
(msdist/run/config.py `TRAIN_OPTIONS`, `EVAL_OPTIONS`) and msdist.launch's own parser.

    python scripts/options_doc.py            # print the reference
    python scripts/options_doc.py --write    # rewrite docs/options.md

tests/unit/test_docs.py fails when docs/options.md differs from what this prints: after a change to an
option, run it with --write.
"""
import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from msdist import launch  # noqa: E402  (after the repository is on the path)
from msdist.base.args import boolean  # noqa: E402
from msdist.cluster import stall  # noqa: E402
from msdist.run import config  # noqa: E402

DOC = os.path.join(REPO, "docs", "options.md")

# Each group starts at the option named here and runs to the next group's first option, in schema order.
GROUPS = (
    ("data_dir", "Data and augmentation"),
    ("model", "Model and fine-tuning"),
    ("epochs", "Optimization"),
    ("grad_compression", "Gradient communication"),
    ("device_target", "Device, speed and logging"),
    (stall.KNOBS[0].name, "Stall detection"),
    ("tensorboard", "Monitoring"),
    ("output_dir", "Checkpoints, resume and evaluation"),
)

HEADER = """# Option reference

Generated from the option schema by `python scripts/options_doc.py --write` (do not edit by hand;
`tests/unit/test_docs.py` checks it is current).

Every option of `python -m msdist.train` (and `msdist.eval`, `msdist.check --plan`) is also a YAML key of
the same name in the file `--config` names; the command line wins over the YAML file, and an unknown key is
an error with a did-you-mean. Booleans take `true`/`false`. `python -m msdist.train --help` prints the same
list. Where the options are explained by task: [training](training.md), [recovery](launch.md),
[performance](performance.md), [clusters](cluster.md).
"""


def _type_name(kind) -> str:
    if kind is boolean:
        return "bool"
    return kind.__name__ if kind in (int, float, str) else "value"


def _bounds(opt: config.Option) -> str:
    parts = []
    if opt.choices:
        parts.append(" / ".join(f"`{c}`" for c in opt.choices))
    if opt.min is not None:
        parts.append(f">= {opt.min:g}")
    if opt.above is not None:
        parts.append(f"> {opt.above:g}")
    if opt.max is not None:
        parts.append(f"<= {opt.max:g}")
    return ", ".join(parts)


def _default(value) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f'`{value}`' if value != "" else '`""`'


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _row(name: str, kind: str, default: str, bounds: str, help_: str) -> str:
    return f"| `{name}` | {kind} | {default} | {bounds} | {_cell(help_)} |"


def _train_groups(options):
    starts = dict(GROUPS)
    names = [opt.name for opt in options]
    missing = [name for name in starts if name not in names]
    if missing:
        raise SystemExit(f"options_doc.py: GROUPS names options the schema no longer has: {missing}")
    lines = []
    for opt in options:
        if opt.name in starts:
            lines += ["", f"## {starts[opt.name]}", "", "| option | type | default | bounds | meaning |",
                      "|---|---|---|---|---|"]
        lines.append(_row(opt.name, _type_name(opt.type), _default(opt.default), _bounds(opt), opt.help))
    return lines


def _eval_only():
    train = {opt.name for opt in config.TRAIN_OPTIONS}
    extra = [opt for opt in config.EVAL_OPTIONS if opt.name not in train]
    lines = ["", "## `msdist.eval` only", "", "| option | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    return lines + [_row(o.name, _type_name(o.type), _default(o.default), _bounds(o), o.help) for o in extra]


def _launcher():
    lines = ["", "## `msdist.launch`", "",
             "The launcher's own options; every other option goes to `msdist.train` (the stall options above are "
             "read by the launcher too).", "",
             "| option | type | default | meaning |", "|---|---|---|---|"]
    for action in launch._build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{s}`" for s in action.option_strings)
        help_, default = _split_default(action)
        kind = "flag" if isinstance(action, argparse._StoreTrueAction) else _type_name(action.type or str)
        lines.append(f"| {flags} | {kind} | {default} | {_cell(help_)} |")
    return lines


def _split_default(action):
    """The launcher's help ends with its default in words, `[a free port]`: clearer than the parser's value."""
    match = re.match(r"(.*) \[(.+)\]$", action.help or "", re.S)
    if match:
        return match.group(1), match.group(2)
    if action.required:
        return action.help, "required"
    if isinstance(action, argparse._StoreTrueAction):
        return action.help, "off"
    return action.help, _default(action.default)


def render() -> str:
    return "\n".join([HEADER.rstrip("\n"), *_train_groups(config.TRAIN_OPTIONS), *_eval_only(), *_launcher()]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {os.path.relpath(DOC, REPO)}")
    args = parser.parse_args()
    text = render()
    if args.write:
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
