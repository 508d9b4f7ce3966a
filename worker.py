"""ASR worker entry point: the same as ``cosyvoice worker``."""

import sys

from cosyvoice.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
