"""pretrain: the training runtime of the recipe repository (config, planner, engines)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"

__all__ = ["REPO_ROOT", "RECIPES_DIR"]
