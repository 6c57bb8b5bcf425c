"""``python -m stubs.vllm_stub serve MODEL ...``"""

import sys

from stubs.vllm_stub.cli import main

sys.exit(main())
