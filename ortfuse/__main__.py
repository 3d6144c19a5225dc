import sys

from ortfuse.cli import main

sys.exit(main())
