"""``python -m hybrid_alloc.demo``: see :mod:`hybrid_alloc.demo.run_demo`."""

import sys

from hybrid_alloc.demo.run_demo import main

if __name__ == "__main__":
    sys.exit(main())
