"""The bundled executable's entry point: `tandem [subcommand …]`, exactly the `tandem` console script
(engine/cli.py; no subcommand opens the desktop app)."""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
