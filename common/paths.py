"""Where the repository lies: its root, recipes/ and conf/ (every command resolves relative paths from here)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
CONF_DIR = REPO_ROOT / "conf"           # option groups (hydra_plugins/ imports nothing of ours: it spells it again)
