"""python -m cluster up|down|status|env|build|image (see cluster/__init__.py)."""

from __future__ import annotations

import argparse
import sys
import time

from cluster import build, up
from cluster.layout import state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="build (or reuse) the binaries and start the cluster; idempotent")
    start.add_argument("--no-image", action="store_true", help="do not build and import the trainer image")
    start.add_argument("--no-kueue", action="store_true", help="do not start Kueue")
    sub.add_parser("down", help="stop every process of the cluster by PID, remove its mounts and bridge")
    sub.add_parser("status", help="the cluster's processes, nodes and version")
    sub.add_parser("env", help="print the environment an Airflow process needs for this cluster")
    sub.add_parser("image", help="build the trainer image and import it into every node")
    sub.add_parser("missing", help="print the components not in the cache yet (exit 1 when any is missing)")
    lose = sub.add_parser("lose-node", help="kill a node's kubelet and every process of its pods (a node lost)")
    lose.add_argument("node", help="atr-node-0 or atr-node-1")
    restore = sub.add_parser("restore-node", help="start a lost node's kubelet again; wait until it is Ready")
    restore.add_argument("node")
    b = sub.add_parser("build", help="build (or reuse) the binaries only")
    b.add_argument("components", nargs="*")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.command == "up":
        up.up(image=not args.no_image, kueue=not args.no_kueue)
    elif args.command == "down":
        up.down()
    elif args.command == "status":
        return up.status()
    elif args.command == "env":
        sys.stdout.write((state().dir / "env").read_text())
    elif args.command == "image":
        up.trainer_image(state())
    elif args.command == "missing":
        missing = build.missing()
        print(" ".join(missing))
        return 1 if missing else 0
    elif args.command == "lose-node":
        up.lose_node(args.node)
    elif args.command == "restore-node":
        up.restore_node(args.node)
    elif args.command == "build":
        build.build_all(args.components or None)
    print(f"[cluster] {args.command}: {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
