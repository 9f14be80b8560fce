import sys

from .verb import main

sys.exit(main())
