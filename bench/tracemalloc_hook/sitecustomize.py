"""Loaded by the operator's Python when `bench/operator_scale.py --tracemalloc FRAMES` puts this folder
first on its PYTHONPATH: a daemon thread waits for request files in $TPUJOB_TRACEMALLOC_DIR. Each
`<label>.request` is answered with `<label>.holders.json` (the deep size of what the process holds,
by holder). The first also starts tracemalloc ($TPUJOB_TRACEMALLOC_FRAMES frames a trace; not at
start-up: the imports under tracing take minutes of CPU, and the bench wants what jobs add, not what
imports cost); each later one also writes `<label>.snapshot` (tracemalloc's dump, read by the bench). Nothing of
the operator's code changes; without the variable this file does nothing.
"""

from __future__ import annotations

import os
import threading

DIRECTORY = os.environ.get("TPUJOB_TRACEMALLOC_DIR")


def _deep_size(roots: list[object], seen: set[int]) -> tuple[int, int]:
    """Bytes and objects reachable from `roots` that no earlier holder reached (`seen`, which also holds
    what is never followed: modules and their globals, types, functions, code, the event loop)."""
    import gc
    import sys
    import types

    stop = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    size = count = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, stop):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj, 0)
        count += 1
        stack.extend(gc.get_referents(obj))
    return size, count


def holders() -> dict[str, dict[str, int]]:
    """What the process holds, by holder, each object counted once, to the first holder that reaches
    it, in this order: kopf's indexes (one row per index), kopf's per-object memories, the operator's
    records of which it keeps many (found by type in the tpujob_operator package), its singletons
    attribute by attribute (the one with the most attributes first: the runtime), the Prometheus
    registry's objects, the asyncio tasks by coroutine (with their frames: kopf's per-object workers),
    and last what only the event loop reaches (its callbacks, transports, buffers)."""
    import asyncio
    import gc
    import sys

    seen: set[int] = {id(vars(module)) for module in list(sys.modules.values()) if module is not None}
    seen.add(id(sys.modules))
    rows: dict[str, dict[str, int]] = {}

    def row(name: str, roots: list[object]) -> None:
        size, count = _deep_size(roots, seen)
        rows[name] = {"bytes": size, "objects": count, "roots": len(roots)}

    everything = gc.get_objects()
    by_type: dict[str, list[object]] = {}
    loops: list[object] = []
    for obj in everything:
        cls = type(obj)
        module = cls.__module__ if isinstance(cls.__module__, str) else ""  # a metaclass's may be a descriptor
        if module.startswith(("kopf.", "tpujob_operator", "prometheus_client")):
            by_type.setdefault(f"{module}.{cls.__qualname__}", []).append(obj)
        if isinstance(obj, asyncio.AbstractEventLoop):
            loops.append(obj)
    del everything
    seen.update(id(loop) for loop in loops)  # reached through everything: counted last, on its own
    for indexer in by_type.get("kopf._core.engines.indexing.OperatorIndexer", []):
        row(f"kopf index {_index_name(indexer)}", [getattr(indexer, "index", None)])
    row("kopf per-object memories (ResourceMemory)", by_type.get("kopf._core.reactor.inventory.ResourceMemory", []))
    ours = {name.removeprefix("tpujob_operator."): objs for name, objs in by_type.items() if name.startswith("tpujob")}
    for name, objects in sorted(ours.items()):  # records kept per job (or per object) first
        if len(objects) > 1:
            row(f"operator {name} (x{len(objects)})", objects)
    singletons = [(name, objects[0]) for name, objects in ours.items() if len(objects) == 1]
    singletons.sort(key=lambda item: -len(getattr(item[1], "__dict__", None) or {}))
    for name, obj in singletons:
        for attribute, value in (getattr(obj, "__dict__", None) or {}).items():
            row(f"operator {name}.{attribute}", [value])
        row(f"operator {name}", [obj])
    prometheus = [o for name, objects in by_type.items() if name.startswith("prometheus_client") for o in objects]
    row("prometheus_client objects", prometheus)
    tasks = list(asyncio.tasks._all_tasks)  # type: ignore[attr-defined]  # a WeakSet, readable from any thread
    coroutines: dict[str, list[object]] = {}
    for task in tasks:
        coro = task.get_coro()
        coroutines.setdefault(getattr(coro, "__qualname__", type(coro).__name__), []).append(task)
    for name, group in sorted(coroutines.items(), key=lambda item: -len(item[1])):
        row(f"asyncio tasks {name}", group)
    for loop in loops:
        seen.discard(id(loop))
        row("the event loop (what only it reaches)", [loop])
    return rows


def _index_name(indexer: object) -> str:
    # OperatorIndexers maps the handler id to its indexer; the indexer itself does not know its id.
    import gc

    for referrer in gc.get_referrers(indexer):
        if isinstance(referrer, dict):
            for key, value in referrer.items():
                if value is indexer:
                    return str(key)
    return "?"


def _serve(directory: str) -> None:
    import json
    import time
    import tracemalloc
    from pathlib import Path

    folder = Path(directory)
    while True:
        for request in sorted(folder.glob("*.request")):
            label = request.stem
            request.unlink()
            started = time.monotonic()
            document: dict[str, object] = {}
            try:
                document["holders"] = holders()
                if tracemalloc.is_tracing():
                    snapshot = tracemalloc.take_snapshot()
                    traced, peak = tracemalloc.get_traced_memory()
                    snapshot.dump(str(folder / f"{label}.snapshot.tmp"))
                    (folder / f"{label}.snapshot.tmp").rename(folder / f"{label}.snapshot")
                    overhead = tracemalloc.get_tracemalloc_memory()
                    document.update(traced_bytes=traced, traced_peak_bytes=peak, tracemalloc_overhead_bytes=overhead)
                else:  # the first request: from now on
                    tracemalloc.start(int(os.environ.get("TPUJOB_TRACEMALLOC_FRAMES") or 16))
            except Exception as error:  # tell the bench, and keep serving
                document["error"] = f"{type(error).__name__}: {error}"
            document["seconds"] = round(time.monotonic() - started, 1)
            (folder / f"{label}.holders.json.tmp").write_text(json.dumps(document))
            (folder / f"{label}.holders.json.tmp").rename(folder / f"{label}.holders.json")
        time.sleep(1.0)


if DIRECTORY:
    threading.Thread(target=_serve, args=(DIRECTORY,), name="tracemalloc-dump", daemon=True).start()
