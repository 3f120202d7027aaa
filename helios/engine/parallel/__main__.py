"""`python -m helios.engine.parallel CORE --rank R ...`: one worker rank (worker.main)."""

import sys

from helios.engine.parallel.worker import main

sys.exit(main())
