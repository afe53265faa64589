"""Hydra discovers this plugin in every app once mbmem-overlays is installed: config group ``mem``."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from mbmem_overlays.core.catalog import builtin_overlay_dir, search_path_entry, user_dirs


class MbmemOverlaysSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # User directories (MBMEM_OVERLAY_DIRS) hold mem/<name>.yaml like the built-ins, or are themselves named
        # mem/: the catalogue's rule (core/catalog.py, overlay_folder), so Hydra finds exactly the files mbmem reads.
        # A directory that is neither is skipped here (a plugin that raises breaks every Hydra app with a
        # traceback); the catalogue reports it (Catalog.problems), and mbmem and train.py refuse it (exit 2).
        for d in user_dirs():
            try:
                entry = search_path_entry(d)
                if entry is not None:
                    search_path.append(provider="mbmem-overlays-user", path=f"file://{entry.resolve()}")
            except OSError:  # an unreadable or looping path: same as missing
                continue
        search_path.append(provider="mbmem-overlays", path=f"file://{builtin_overlay_dir()}")
