"""The ground floor (docs/architecture.md): every config section and every compose-time rule.

* schema.py - `JobConfig` and its sections, each field a typed one-line doc.
* compose.py - Hydra composition of a recipe + overrides, `load_recipe`, `finalize`, YAML in and out.
* validate.py - the collect-all validation of every section (cross-section rules and the registries' names).
* derive.py - values derived from the config (batch ramp, train iterations, pipeline stage layers).
* data.py, moe.py, observability.py - sections and rules of their chapters.
* epochs.py - epochs over each train source of data.blend (from the .idx headers), warned and refused.
* __main__.py - `make config`.
"""
