import sys

from eval_harness.cli.coveil import main

sys.exit(main())
