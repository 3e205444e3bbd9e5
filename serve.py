"""Start the ModeSwitch server: ``python serve.py --model demo`` (see ``--help``)."""

import sys

from modeswitch.logs import quiet_libraries

quiet_libraries()  # first, also in the engine processes vLLM spawns (they import this module before anything)

from modeswitch.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
