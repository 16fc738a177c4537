"""Hydra search-path plugin: recipes in recipes/ compose option groups from conf/.

Hydra discovers plugins in the `hydra_plugins` namespace package; this one appends the
repository's conf/ directory so `recipes/<name>.yaml` can name `model: gpt3-125m` etc.
"""
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class PretrainSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="pretrain-conf", path=f"file://{CONF_DIR}")
