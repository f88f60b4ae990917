#!/usr/bin/env python
"""Plan and run recomputation for a network: see ``--help``.

    python scripts/run_schedule.py --model resnet152 --budget 8G
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from chainer_recompute.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
