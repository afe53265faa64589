"""Hydra discovers this plugin in every app once mbmem-overlays is installed: config group ``mem``."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from mbmem_overlays.core.catalog import builtin_overlay_dir, user_dirs


class MbmemOverlaysSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # User directories (MBMEM_OVERLAY_DIRS) hold mem/<name>.yaml like the built-ins. A directory that
        # does not exist is skipped here (a plugin that raises breaks every Hydra app with a traceback);
        # the catalogue reports it (core/catalog.py, Catalog.problems).
        for d in user_dirs():
            try:
                if d.is_dir():
                    search_path.append(provider="mbmem-overlays-user", path=f"file://{d.resolve()}")
            except OSError:  # an unreadable or looping path: same as missing
                continue
        search_path.append(provider="mbmem-overlays", path=f"file://{builtin_overlay_dir()}")
