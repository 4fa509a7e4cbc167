import sys

from kxlb.cli import main

sys.exit(main())
