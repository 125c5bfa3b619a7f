"""``python -m duetserve.calibrate ...``: the ``duetserve calibrate`` command without the main CLI
(the GPU machine has no FastAPI, which the main CLI's ``serve`` needs)."""

import argparse
import sys

from duetserve.argtypes import exit_on_interrupt
from duetserve.calibrate.cli import configure_parser, run


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv``) and calibrate; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m duetserve.calibrate", description=__doc__)
    configure_parser(parser)
    args = parser.parse_args(argv)
    return exit_on_interrupt("calibrate", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
