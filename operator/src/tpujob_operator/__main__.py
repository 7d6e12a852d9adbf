"""`python -m tpujob_operator`: run the operator (kopf) with a liveness endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from . import handlers  # noqa: F401  (registers the handlers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="tpujob operator")
    parser.add_argument("--namespace", action="append", help="watch only these namespaces (default: all)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace or [],
            liveness_endpoint=args.liveness,
            standalone=True,
        )
    )


if __name__ == "__main__":
    main()
