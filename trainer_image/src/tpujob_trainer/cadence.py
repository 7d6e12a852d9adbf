"""Moved to the trainer library: `tpujob.cadence` (library/src/tpujob/cadence.py).

Kept only so that links to this path resolve until docs/concepts/checkpoints.md points at the
library; delete it with that change. Nothing imports it.
"""

from tpujob.cadence import *  # noqa: F403
