"""What other installed packages lend sled by name: Python entry points in a named group (the lab
registers its trace drafter under sled.drafters, its boards and links under sled.emulation).

    plugin("sled.drafters", "trace")     # the EntryPoint, or None
    plugin_names("sled.drafters")        # ["trace"]
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points


def plugin(group: str, name: str) -> EntryPoint | None:
    """The entry point NAME of GROUP, or None when no installed package registers one."""
    return next(iter(entry_points(group=group, name=name)), None)


def plugin_names(group: str) -> list[str]:
    """The names registered in GROUP, sorted."""
    return sorted({point.name for point in entry_points(group=group)})
