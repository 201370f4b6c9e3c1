"""Build a random-weight Qwen-VL checkpoint dir (same as `vagent make-tiny-model`).

python tools/make_tiny_model.py --family qwen2_5_vl --out /tmp/tiny [--size tiny] [--seed 0]
"""

import sys

from vagent.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["make-tiny-model", *sys.argv[1:]]))
