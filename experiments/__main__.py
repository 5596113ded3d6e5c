"""python -m experiments {threads,kvcache,quant} [--quick] [--out DIR] ...
   python -m experiments replot DIR/NAME.json

Each experiment shows a progress bar, prints a markdown table and writes <out>/<name>.json,
<out>/<name>.png and <out>/<name>.md. --quick runs a small version (under a minute) for tests.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from experiments import common, kvcache, quant, threads

EXPERIMENTS = {"threads": threads, "kvcache": kvcache, "quant": quant}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="experiment", required=True)
    for name, module in EXPERIMENTS.items():
        p = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        p.add_argument("--quick", action="store_true", help="a small version, under a minute")
        p.add_argument("--out", type=Path, default=Path("results/experiments"),
                       help="output folder (default: results/experiments)")
        p.add_argument("--model", type=Path, default=common.DEFAULT_MODEL, help="GGUF model")
        p.add_argument("--repeats", type=int, help="repetitions of each measurement")
        module.add_arguments(p)
    p = sub.add_parser("replot", help="redraw the PNG and table of a result JSON (no measuring)")
    p.add_argument("json", type=Path)
    return parser.parse_args(argv)


def replot(path: Path) -> None:
    result = json.loads(path.read_text())
    module = EXPERIMENTS[result["experiment"]]
    markdown = module.report(result)
    print(markdown)
    common.write_outputs(path.parent, result["experiment"], result, markdown, module.plot(result))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.experiment == "replot":
        replot(args.json)
        return 0
    if not args.model.is_file():
        print(f"model not found: {args.model} (run `make setup`)", file=sys.stderr)
        return 2
    EXPERIMENTS[args.experiment].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
