"""Support code for ``recipes/`` and the ``amp-trainer`` CLI: data loading, tokenizers trained on
the train split, recipe models, config files, reporting, and what both recipes share.

Not public API: nothing here is re-exported by :mod:`amp_trainer`, and names, signatures and
modules may change in any release without notice. Use the top-level ``amp_trainer`` names.
"""
