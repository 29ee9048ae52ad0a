import sys

from ramjet.cli import main

sys.exit(main())
