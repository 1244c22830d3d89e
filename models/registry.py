"""A tiny model registry: models register by name, the trainer only knows names."""
import logging
from typing import Callable, Dict, List

_logger = logging.getLogger(__name__)
_MODELS: Dict[str, Callable] = {}


def register_model(fn: Callable) -> Callable:
    """Decorator: make `fn(num_classes, **kw)` available as `create_model(fn.__name__, ...)`."""
    if fn.__name__ in _MODELS:
        _logger.warning("model %s registered twice; the later definition wins", fn.__name__)
    _MODELS[fn.__name__] = fn
    return fn


def list_models() -> List[str]:
    return sorted(_MODELS)


def create_model(name: str, num_classes: int, **kwargs):
    """Build a registered model.

    Args:
        name: a name from `list_models()`.
        num_classes: size of the classifier output.
        **kwargs: passed to the model's factory (e.g. zero_init_last_bn).

    Raises:
        ValueError: unknown model name.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    return _MODELS[name](num_classes=num_classes, **kwargs)
