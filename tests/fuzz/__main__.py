"""``python -m tests.fuzz``: the fuzzer's command line (see :mod:`tests.fuzz`)."""

import sys

from tests.fuzz import main

sys.exit(main())
