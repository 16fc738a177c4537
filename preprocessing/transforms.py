"""Text transforms of kept documents, registered by name; `transforms` in the config picks them, in order.

A transform changes a document's text instead of dropping it (the quality filters of
preprocessing/filters.py drop). It is a factory: given the whole preprocessing config it returns
a callable `text -> text` with a `counts` Counter of what it replaced, by kind, so the stage
summary says exactly what changed. A transform returns the very same string object when it
changes nothing, so unchanged documents stay byte-identical and are cheap to recognise.
Built in: `pii` (preprocessing/pii.py). One defined anywhere registers itself:

    from collections import Counter
    from preprocessing.transforms import register_transform

    @register_transform("strip_tabs")
    def strip_tabs(cfg):
        class StripTabs:
            counts = Counter()
            def __call__(self, text):
                n = text.count("\\t")
                self.counts["tab"] += n
                return text.replace("\\t", " ") if n else text
        return StripTabs()

    # preprocessing config: imports: [my_transforms]   transforms: [pii, strip_tabs]
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, List, Protocol, Tuple, runtime_checkable

from common.config import ConfigError
from common.registry import Registry

from .config import PreprocessConfig


@runtime_checkable
class Transform(Protocol):
    """`transform(text)` -> the new text (the same object when nothing changed); `counts`: replacements by kind."""
    counts: Counter

    def __call__(self, text: str) -> str: ...


TransformFactory = Callable[[PreprocessConfig], Transform]

TRANSFORMS: Registry[TransformFactory] = Registry("text transform", "transforms")
# Built in, registered lazily: pii.py needs nothing from this module, and no import in either direction
# keeps the import graph a tree whichever of the two is imported first.
TRANSFORMS.register("pii", "preprocessing.pii:pii_transform")


def register_transform(name: str) -> Callable[[TransformFactory], TransformFactory]:
    """Decorator: register a transform factory `(preprocessing config) -> Transform`."""
    return TRANSFORMS.register(name)


def _build(cfg: PreprocessConfig) -> Tuple[List[Tuple[str, Transform]], List[str]]:
    """The config's transforms, built, and every problem found: unknown names, and the factories' own
    ConfigErrors (a transform's settings are checked when it is built, which is cheap)."""
    built: List[Tuple[str, Transform]] = []
    problems: List[str] = []
    for i, name in enumerate(cfg.transforms):
        if name not in TRANSFORMS:
            problems.append(f"transforms[{i}]={name!r} is not a registered text transform. Registered: "
                            f"{list(TRANSFORMS.names())}. Fix: pick one of those, or register one with "
                            f"@preprocessing.transforms.register_transform({name!r}) in a module listed in the "
                            "config's `imports`; `transforms: []` applies none.")
            continue
        try:
            transform = TRANSFORMS.get(name)(cfg)
        except ConfigError as err:
            problems += err.problems
            continue
        if not isinstance(transform, Transform):
            problems.append(f"transforms[{i}]={name!r}: its factory returned {type(transform).__name__}, which has "
                            "no `counts` or is not callable. Fix: return an object with `__call__(text) -> str` "
                            "and a `counts` Counter.")
            continue
        built.append((name, transform))
    return built, problems


def transform_problems(cfg: PreprocessConfig) -> List[str]:
    """What in `transforms` (and the settings the named transforms read) cannot run, each with its fix."""
    return _build(cfg)[1]


class TextTransforms:
    """Every transform of `cfg.transforms`, in order, on one document at a time.

    `counts` merges the transforms' replacements by kind; `changed` counts documents whose text changed.
    """

    def __init__(self, cfg: PreprocessConfig):
        self.transforms, problems = _build(cfg)
        if problems:
            raise ConfigError(problems, source="transforms")
        self.changed = 0

    def __call__(self, text: str) -> str:
        out = text
        for _, transform in self.transforms:
            out = transform(out)
        if out is not text and out != text:
            self.changed += 1
        return out

    @property
    def counts(self) -> Counter:
        total: Counter = Counter()
        for _, transform in self.transforms:
            total.update(transform.counts)
        return total

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self.transforms]
