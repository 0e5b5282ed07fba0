"""`python -m lmstack.cli train cfg.yaml` (the form `accelerate launch -m lmstack.cli` uses)."""

import sys

from lmstack.cli.main import main

sys.exit(main())
