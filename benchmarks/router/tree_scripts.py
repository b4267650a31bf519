"""The Lua scripts of another router tree (a git archive of an older commit),
loaded without disturbing this process's own `router` package."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

# Where the scripts lived: now, and before the router was split into packages.
SCRIPT_MODULES = ("router/persistence/lua.py", "router/persistence/lua_routers.py",
                  "router/lua.py")


def _drop_router_modules() -> None:
    for name in [m for m in sys.modules if m == "router" or m.startswith("router.")]:
        del sys.modules[name]


def tree_scripts(tree: Path) -> dict[str, str]:
    """{constant name: script text} of every Lua script a tree's modules define."""
    scripts: dict[str, str] = {}
    saved = {m: mod for m, mod in sys.modules.items() if m == "router" or m.startswith("router.")}
    sys.path.insert(0, str(tree))
    try:
        for rel in SCRIPT_MODULES:
            path = Path(tree) / rel
            if not path.exists():
                continue
            _drop_router_modules()   # its imports must resolve inside that tree
            spec = importlib.util.spec_from_file_location(f"tree_scripts_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            scripts.update({k: v for k, v in vars(module).items()
                            if isinstance(v, str) and "redis.call" in v})
    finally:
        sys.path.pop(0)
        _drop_router_modules()
        sys.modules.update(saved)
    return scripts


def names_by_sha(tree: Path) -> dict[str, str]:
    """{sha1 of a script: its constant name}, as EVALSHA names them."""
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in tree_scripts(tree).items()}
