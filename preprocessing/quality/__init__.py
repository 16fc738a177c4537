"""Document quality rules and classifiers registered as `filters.names` entries (preprocessing.filters); each
module registers itself when imported."""
