"""``python -m duetserve.bench ...``: the ``duetserve bench`` command without the main CLI."""

import argparse
import sys

from duetserve.argtypes import exit_on_interrupt, join_negative_values
from duetserve.bench import cli
from duetserve.bench.cli import configure_parser, run


def main() -> int:
    """Parse ``sys.argv`` and run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m duetserve.bench", description=cli.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))
    return exit_on_interrupt("bench", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
