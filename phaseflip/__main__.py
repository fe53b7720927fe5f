"""`python -m phaseflip ...`: the `phaseflip` command."""

import sys

from phaseflip.cli import entry

if __name__ == "__main__":  # (a spawned rank imports this module as __mp_main__)
    sys.exit(entry())
