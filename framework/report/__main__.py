"""`python -m framework.report <sweep dir>`: compare a sweep's runs (framework/report/compare.py)."""

import sys

from framework.report.compare import main

sys.exit(main(sys.argv[1:]))
