import sys

from asyncrl.run.cli import main

sys.exit(main())
