"""preprocessing package."""
