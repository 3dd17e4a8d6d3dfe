"""Run a backfit CLI command with runtime switches set first (bench_ab.py's --switch syntax), so
a check such as `backfit verify` can run a configuration that is not shipped yet (a switch an
A/B is about to flip):

    python3 benchmarks/with_switches.py \
        --switch backfit.runtime.kernels.attention.decode:MAX_SPLIT=32 \
        --switch "backfit.runtime.model.attention_decode:QUERY_FIRST=(1, 8)" \
        -- verify ORIG CONVERTED --device cuda --kernels triton --chunk 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ab import parse_switches  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("with_switches.py: --switch ... -- <backfit command and arguments>")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", action="append", default=[], metavar="MODULE:NAME=VALUE")
    a = ap.parse_args(argv[:cut])
    for spec in a.switch:
        for mod, name, value in parse_switches(spec):
            setattr(mod, name, value)
            print(f"with_switches: {mod.__name__}.{name} = {value!r}", file=sys.stderr)
    from backfit.cli import main as backfit_main
    sys.argv = ["backfit", *argv[cut + 1:]]
    backfit_main()


if __name__ == "__main__":
    main()
