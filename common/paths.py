"""Where the repository lies: its root and recipes/ (every command resolves relative paths from here)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
