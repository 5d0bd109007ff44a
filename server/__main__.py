"""``python -m gradserve.server serve …`` (the word ``serve`` may be left out)."""

import sys

from gradserve.server.transport.entry import main

argv = sys.argv[1:]
if not argv or argv[0] not in ("serve", "health", "-h", "--help"):
    argv = ["serve", *argv]
sys.exit(main(argv))
