"""Summarize a timeline CSV that `megamoe profile --cycles --trace DIR` wrote (one per config and
rank) again, e.g. with finer time bins:

    python3 scripts/trace_timeline.py DIR/trace_16384_block_m128_num_stages4_ws1_r0.csv --bin-us 1
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamoe_cli.bench.timeline import read_csv, summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--bin-us", type=float, default=2.0)
    args = ap.parse_args()
    print(summarize(read_csv(args.csv), args.bin_us))


if __name__ == "__main__":
    main()
