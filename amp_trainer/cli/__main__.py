"""``python -m amp_trainer.cli``: the ``amp-trainer`` command without the console script."""

import sys

from amp_trainer.cli import main

if __name__ == "__main__":  # importing the module (the package's import checks do) runs nothing
    sys.exit(main())
