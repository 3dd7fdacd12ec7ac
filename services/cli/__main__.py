"""`python -m services.cli ...`, as the `castor` console script."""

import sys

from services.cli.main import main

sys.exit(main())
