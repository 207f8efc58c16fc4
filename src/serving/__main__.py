import sys

from .host.commands import main

sys.exit(main())
