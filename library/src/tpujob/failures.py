"""What a failed storage or restore call says: the data is damaged, it does not fit this trainer,
storage refused us, or something passing went wrong. A pure function of the exception, so that
the texts the clients really raise (tensorstore, Orbax, gcsfs, JAX) are table-tested.

Only the data may condemn a checkpoint: an error counts as damage when a link of its chain says a
file is missing or unreadable (404, 416, a truncated or undecodable stream, metadata that does not
parse) or that the stored arrays do not fit (shape, tree structure). Anything else, recognized
(timeouts, 408/429/5xx, connection errors, out of memory, a barrier's DEADLINE_EXCEEDED) or not,
is transient: retried, never a reason to give a step up.
"""

from __future__ import annotations

import enum
import json
import re

import tpujob_contract as contract

from tpujob.bounded import StorageTimeout


class Kind(enum.IntEnum):
    """How one process saw a failure; when processes disagree the largest wins (see restore)."""

    MISMATCH = 1  # readable, but not this trainer's state (shape, tree): fall back, leave it in place
    DAMAGED = 2  # unreadable or missing data while storage answers: fall back, quarantine the step
    TRANSIENT = 3  # try the same thing again later
    DENIED = 4  # storage refused our identity (401/403): no retry can help (exit 5)


class CheckpointMismatch(RuntimeError):
    """A step's data says something else than its name (it holds another step): damage."""


# Status codes as tensorstore, XLA and the JAX coordination service print them ("CODE: message").
_STATUS = re.compile(
    r"\b(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|PERMISSION_DENIED"
    r"|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|INTERNAL|UNAVAILABLE"
    r"|DATA_LOSS|UNAUTHENTICATED):"
)
_HTTP = re.compile(r"http_response_code='(\d{3})'")
_STATUS_KINDS: dict[str, Kind] = {
    "PERMISSION_DENIED": Kind.DENIED,
    "UNAUTHENTICATED": Kind.DENIED,
    "UNAVAILABLE": Kind.TRANSIENT,
    "DEADLINE_EXCEEDED": Kind.TRANSIENT,  # also a barrier or collective that timed out
    "RESOURCE_EXHAUSTED": Kind.TRANSIENT,  # XLA's out of memory; tensorstore's throttling
    "ABORTED": Kind.TRANSIENT,
    "CANCELLED": Kind.TRANSIENT,
    "NOT_FOUND": Kind.DAMAGED,  # a file of the step is missing (storage answered)
    "OUT_OF_RANGE": Kind.DAMAGED,  # a read past the end of a truncated file (416)
    "DATA_LOSS": Kind.DAMAGED,
    "FAILED_PRECONDITION": Kind.DAMAGED,  # tensorstore: a stream that does not decode (zstd, riegeli)
    "INVALID_ARGUMENT": Kind.DAMAGED,  # tensorstore: metadata that does not parse
}
# Orbax/JAX: the stored arrays do not fit the state this trainer restores into.
_MISMATCH = re.compile(
    r"not compatible with the stored shape|pytree structure error|tree structures? (do not|don't) match"
    r"|shape mismatch|Dict key mismatch|Custom node type mismatch",
    re.IGNORECASE,
)
_OOM = re.compile(r"out of memory|Barrier timed out|timed out", re.IGNORECASE)
# Exception classes of the clients, by name (no import of them here): connection-level failures.
_TRANSIENT_TYPES = frozenset(
    {
        "ClientConnectionError",  # aiohttp (gcsfs): refused, reset, server disconnected
        "ClientPayloadError",
        "ServerTimeoutError",
        "ConnectionError",  # requests, builtins
        "Timeout",  # requests
        "ChunkedEncodingError",
        "ProxyError",  # gcsfs raises it for a 502
        "TransportError",  # google.auth: the metadata server did not answer
        "RefreshError",  # google.auth: no token yet (Workload Identity starting up)
        "IncompleteRead",
    }
)


def _http_kind(code: int) -> Kind | None:
    if code in (401, 403):
        return Kind.DENIED
    if code in (408, 429) or 500 <= code < 600:
        return Kind.TRANSIENT
    if code in (404, 416):
        return Kind.DAMAGED
    return None


def _link_kind(err: BaseException) -> Kind | None:
    """What one exception of a chain says by itself, or None."""
    if isinstance(err, PermissionError):
        return Kind.DENIED
    if isinstance(err, MemoryError | TimeoutError | StorageTimeout):
        return Kind.TRANSIENT
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & _TRANSIENT_TYPES:
        return Kind.TRANSIENT
    code = getattr(err, "code", None)  # gcsfs HttpError, google.api_core's exceptions
    if isinstance(code, int) and (kind := _http_kind(code)) is not None:
        return kind
    text = str(err)
    if isinstance(err, OSError) and text.startswith("Forbidden:"):  # gcsfs's 403
        return Kind.DENIED
    if isinstance(err, CheckpointMismatch | FileNotFoundError | json.JSONDecodeError | UnicodeDecodeError | EOFError):
        return Kind.DAMAGED
    kinds = {_STATUS_KINDS[c] for c in _STATUS.findall(text) if c in _STATUS_KINDS}
    kinds |= {k for c in _HTTP.findall(text) if (k := _http_kind(int(c))) is not None}
    if _MISMATCH.search(text):
        kinds.add(Kind.MISMATCH)
    if not kinds and _OOM.search(text):
        kinds.add(Kind.TRANSIENT)
    return max(kinds) if kinds else None


def chain(err: BaseException) -> list[BaseException]:
    """err, its cause or context, theirs, ...; each once."""
    seen: list[BaseException] = []
    link: BaseException | None = err
    while link is not None and all(link is not s for s in seen):
        seen.append(link)
        link = link.__cause__ or link.__context__
    return seen


def classify(err: BaseException) -> Kind:
    """The verdict of the whole chain: a refusal, then anything transient, then damage, then a
    mismatch; an error that says nothing recognizable is transient (never damage)."""
    kinds = [k for link in chain(err) if (k := _link_kind(link)) is not None]
    return max(kinds) if kinds else Kind.TRANSIENT


def short_error(err: BaseException) -> str:
    """`Type: message` on one line, cut to the contract's limit."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    limit = contract.ERROR_TEXT_LIMIT
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What a restore error says about the bytes themselves: they were read and do not decode or check out.
_UNDECODABLE = re.compile(
    r"DATA_LOSS|OUT_OF_RANGE|truncated|corrupt|checksum|does not decode|failed to decode|unexpected end of",
    re.IGNORECASE,
)
_PATH_CHARS = r"[^\s\"'`,;()\[\]{}<>]*"


def undecodable(err: BaseException) -> bool:
    """Whether a link of the chain says the data was read and its bytes do not decode: evidence from
    the data itself (a missing file, a metadata file that does not parse, are found by reading back)."""
    return any(_UNDECODABLE.search(str(link)) for link in chain(err))


def named_step_files(err: BaseException, step_dir: str) -> list[str]:
    """The files under `step_dir` that the error chain names (relative to it; gs:// object names as the
    JSON API prints them, %2F-encoded, too): the ones to read back before the step is condemned."""
    marker = "/".join(step_dir.rstrip("/").split("/")[-2:]) + "/"  # <checkpoints dir>/<step>/
    found: list[str] = []
    for link in chain(err):
        text = str(link).replace("%2F", "/").replace("%2f", "/")
        for match in re.finditer(re.escape(marker) + f"({_PATH_CHARS})", text):
            name = match.group(1).rstrip("/.")
            if name and name not in found:
                found.append(name)
    return found
