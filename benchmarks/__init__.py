"""amp-trainer's benchmarks: one folder per topic, one entry point (``python -m benchmarks``).

Not part of the installed package (``pyproject.toml`` installs ``amp_trainer`` only): the
benchmarks are run from a checkout, where they measure that checkout's code.
"""
