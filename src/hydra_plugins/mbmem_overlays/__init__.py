"""Hydra discovers this plugin in every app once mbmem-overlays is installed: config group ``mem``."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from mbmem_overlays.core.catalog import builtin_overlay_dir, user_dirs


class MbmemOverlaysSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # User directories (MBMEM_OVERLAY_DIRS) hold mem/<name>.yaml like the built-ins.
        for d in user_dirs():
            search_path.append(provider="mbmem-overlays-user", path=f"file://{d.resolve()}")
        search_path.append(provider="mbmem-overlays", path=f"file://{builtin_overlay_dir()}")
