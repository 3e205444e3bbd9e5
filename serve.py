"""Start the ModeSwitch server: ``python serve.py --model demo`` (see ``--help``)."""

import sys

from modeswitch.server import main

if __name__ == "__main__":
    sys.exit(main())
