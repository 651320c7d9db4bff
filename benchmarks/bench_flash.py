"""Benchmarks of the tiled ("flash") backend against its anchors (docs/results/attnlab_bench.md).

Same as ``attnlab bench``::

    python benchmarks/bench_flash.py                 # every case, the sizes of the targets
    python benchmarks/bench_flash.py --case window   # one case
    python benchmarks/bench_flash.py --quick         # a smoke run at L/8
    python benchmarks/bench_flash.py --plot flash.png --json flash.json
    python benchmarks/bench_flash.py --dtype float32 bfloat16 --clock cpu --threads 1
    python benchmarks/bench_flash.py --calibrate --dtype float32 bfloat16   # auto's thresholds
"""

from __future__ import annotations

import sys

from attnlab.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
