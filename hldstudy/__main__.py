import sys

from hldstudy.cli import main

sys.exit(main())
