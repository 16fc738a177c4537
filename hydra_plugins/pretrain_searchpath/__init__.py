"""Hydra search-path plugin (searchpath.py): recipes in recipes/ compose option groups from conf/."""
