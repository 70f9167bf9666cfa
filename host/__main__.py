import sys

from host.process import main  # the console script's own entry: settings, then the CLI

sys.exit(main())
