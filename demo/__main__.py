"""`python -m demo`: run the demo (`demo.main`) and exit with its status."""

import sys

from demo.main import main

sys.exit(main())
