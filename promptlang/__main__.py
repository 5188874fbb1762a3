import sys

from promptlang.cli import main

sys.exit(main())
