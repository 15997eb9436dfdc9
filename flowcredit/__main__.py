import sys

from flowcredit.cli import main

sys.exit(main())
