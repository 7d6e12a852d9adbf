"""Print a JSON map {leaf path: sha256 of its bytes} of one checkpointed step (run as a subprocess).

Usage: python digest.py CHECKPOINT_DIR STEP [NPZ]. Restores every array onto this process's first
device, whatever mesh wrote it, so runs on different processes can be compared bit for bit; NPZ,
if given, also gets the arrays themselves (keyed by leaf path) for comparisons within a tolerance.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def main(directory: str, step: int, npz: str | None = None) -> None:
    item = f"{directory}/{step}/default"
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
        checkpointer.metadata(item).item_metadata,
    )
    state = checkpointer.restore(item, target)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    digests = {
        jax.tree_util.keystr(path): hashlib.sha256(np.asarray(leaf).tobytes()).hexdigest() for path, leaf in leaves
    }
    if npz:
        arrays: dict[str, Any] = {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
        np.savez(npz, **arrays)
    print(json.dumps(digests, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
