"""`python -m radixserve.launch_server [flags]`: the same as `radixserve serve [flags]`."""

from __future__ import annotations

import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
