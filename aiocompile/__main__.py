import sys

from aiocompile.cli import main

sys.exit(main())
