"""A tiny model registry: models register by name, the trainer only knows names.

A model's name is written once, as its `@register_model` factory in its family module. The names are
known before MindSpore loads, so a mistyped `--model` is caught at start-up (`unknown_model_message`):
they are read from the family module's syntax tree (`ast`), not by importing it, because importing it
imports MindSpore. (A name list beside the functions, as before, was a second copy to keep in step; reading
the source costs ~10 ms once per process.) The family module itself is imported on first use, and its
`@register_model` factories fill in the callables.
"""
import ast
import difflib
import functools
import importlib
import importlib.util
import logging
from typing import Callable, Dict, List, Tuple

_logger = logging.getLogger(__name__)
_FAMILIES: List[str] = ["models.resnet"]   # modules whose @register_model functions are models
_MODELS: Dict[str, Callable] = {}
# How a network pads its parameter-free layers, after the framework its weights were trained in: "mindspore"
# (pad_mode="same": the model zoo, MindCV, msdist's own training) or "torch" (symmetric, as torchvision and timm).
# The weights decide (msdist.run.weights); checkpoints record it in their metadata.
CONVENTIONS = ("mindspore", "torch")
DEFAULT_CONVENTION, TORCH_CONVENTION = CONVENTIONS


def add_family(module: str) -> None:
    """Make the models `module` defines with `@register_model` known by name (the module is not imported)."""
    if module not in _FAMILIES:
        _FAMILIES.append(module)


@functools.lru_cache(maxsize=None)
def _registered_names(module: str) -> Tuple[str, ...]:
    """The names of the top-level functions decorated `@register_model` in `module`'s source, unimported."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ValueError(f"model family {module!r} not found")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    return tuple(node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                 and any(_is_register_model(d) for d in node.decorator_list))


def _is_register_model(decorator: ast.expr) -> bool:
    """`@register_model` or `@registry.register_model` (any module path)."""
    return (isinstance(decorator, ast.Name) and decorator.id == "register_model") or \
        (isinstance(decorator, ast.Attribute) and decorator.attr == "register_model")


def register_model(fn: Callable) -> Callable:
    """Decorator: make `fn(num_classes, **kw)` available as `create_model(fn.__name__, ...)`."""
    if fn.__name__ in _MODELS:
        _logger.warning("model %s registered twice; the later definition wins", fn.__name__)
    _MODELS[fn.__name__] = fn
    return fn


def list_models() -> List[str]:
    """Every model name, without importing any model code."""
    return sorted(name for module in _FAMILIES for name in _registered_names(module))


def unknown_model_message(name: str) -> str:
    """'' for a known model name, else a one-line message with a did-you-mean."""
    if name in list_models():
        return ""
    close = difflib.get_close_matches(name, list_models(), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown model {name!r}; {hint}choose one of {', '.join(list_models())}"


def create_model(name: str, num_classes: int, **kwargs):
    """Build a registered model.

    Args:
        name: a name from `list_models()`.
        num_classes: size of the classifier output.
        **kwargs: passed to the model's factory (e.g. zero_init_last_bn).

    Raises:
        ValueError: unknown model name.
    """
    problem = unknown_model_message(name)
    if problem:
        raise ValueError(problem)
    module = next(m for m in _FAMILIES if name in _registered_names(m))
    importlib.import_module(module)  # runs its @register_model decorators
    return _MODELS[name](num_classes=num_classes, **kwargs)
