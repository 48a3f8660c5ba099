import sys

from nodescale.cli.main import main

sys.exit(main())
