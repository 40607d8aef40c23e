"""Adds `pkg://mist_ds.conf` to every Hydra app's config search path.

A user's own app can then write `defaults: [{model: llama2-7b}, {cluster: a100-80g}]` and get
mist_ds's zoo, validated against the same schemas (registered here, since the app does not call
`mist_ds.config.register_configs()` itself).
"""
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class MistDsSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from mist_ds.config import register_configs

        register_configs()
        search_path.append(provider="mist_ds", path="pkg://mist_ds.conf")
