"""Test-only driver for test_ray.py: `lmstack train <args>` under USE_RAY=1 whose Ray workers run
reliability_driver.py (and so its LMSTACK_TEST_HOOK, which reaches them with the rest of the driver's
environment) instead of lmstack's own entry. Nothing of it exists in the product code."""

import sys
from pathlib import Path

from lmstack.launch import ray as ray_launch

ray_launch.WORKER_ENTRY = str(Path(__file__).with_name("reliability_driver.py"))

if __name__ == "__main__":
    from lmstack.cli.main import main

    sys.exit(main(["train", *sys.argv[1:]]))
