"""Recipe -> one validated, typed JobConfig. See compose.load_recipe."""
from .compose import config_diff, finalize, load_recipe, to_yaml
from .schema import JobConfig
from .validate import ConfigError

__all__ = ["ConfigError", "JobConfig", "config_diff", "finalize", "load_recipe", "to_yaml"]
