"""`python -m flashllm_ext.cli`: the `flashllm` command."""

import sys

from flashllm_ext.cli import main

sys.exit(main())
