"""quadriga COMMAND [ARGS...]: one command for every part of the system.

Each command runs the same main as its `python -m MODULE` form, with ARGS
passed through untouched, so `quadriga COMMAND --help` shows that module's flags.
"""

from __future__ import annotations

import runpy
import sys

# command -> (module run as __main__, what it is)
COMMANDS = {
    "serve": ("stack", "a local stack in one command: Redis, a router and replicas (as `stack`)"),
    "stack": ("stack", "the local stack: Redis, a router and N replicas on this machine"),
    "router": ("router", "the router: client API, replica registry, global scheduler"),
    "replica": ("replica_worker", "a replica worker: one engine that dials the router"),
    "client": ("client", "send a prompt to a router and stream the answer"),
    "bench": ("benchmarks", "the load-testing harness against a live system"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {what}" for name, (_, what) in COMMANDS.items())
    return f"usage: quadriga COMMAND [ARGS...]\n\ncommands:\n{rows}\n\n`quadriga COMMAND --help` lists a command's flags."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"quadriga: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = COMMANDS[command][0]
    sys.argv = [f"quadriga {command}", *rest]
    # The module's own `sys.exit(main())` ends the process with its status.
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
