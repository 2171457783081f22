import sys

from harvest.cli import main

sys.exit(main())
