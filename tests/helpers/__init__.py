"""What several test files share: tiny models, tokenizers, datasets, callbacks and runners.

Imported by the tests (``from tests.helpers.tiny_models import tiny_t5``) and by the two-rank
workers; pytest collects nothing here (no ``test_`` names). Fixtures stay in ``tests/conftest.py``.

* :mod:`tests.helpers.tiny_models`: models built from configs (nothing is downloaded), their
  batches, tokenizers trained here and saved checkpoints;
* :mod:`tests.helpers.training`: tiny datasets, overflow-injecting callbacks, a tiny run's
  arguments;
* :mod:`tests.helpers.repo`: the checkout's root and the environment of a subprocess that runs it;
* :mod:`tests.helpers.distributed`: two gloo ranks under torchrun, and what their workers need;
* :mod:`tests.helpers.recipes`: the recipes and the ``accelerate`` command, run as a user runs
  them;
* :mod:`tests.helpers.cli`: what the CLI tests read from captured output.
"""
