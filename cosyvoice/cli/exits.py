"""The command's exit statuses (the table in docs/cli.md, "Exit status") and the error
that ends a command with one of them."""

from __future__ import annotations

EXIT_OK = 0
# The work failed once it had started: the stream ended with a server error or without
# its end within --timeout; a process of `serve` exited; model data failed verification;
# the gateway's port is taken.
EXIT_FAILED = 1
# A bad command line or setting (a flag, a COSYVOICE_* variable, a URL); argparse's own.
EXIT_USAGE = 2
# An input file that is missing, unreadable, or not audio cosyvoice reads.
EXIT_INPUT = 3
# No cosyvoice service answers at the URL, or the connection was lost and not restored.
EXIT_UNREACHABLE = 4
# The service refused the session (overloaded after the retries, unauthorized, ...).
EXIT_REFUSED = 5
# Stopped by Ctrl-C.
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """Ends a command with one line on stderr and ``status``."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


