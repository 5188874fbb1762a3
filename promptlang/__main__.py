import sys

from promptlang.cli import main

if __name__ == "__main__":         # not when a spawned child process imports this module
    sys.exit(main())
