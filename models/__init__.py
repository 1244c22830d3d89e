"""Model zoo: `create_model(name, num_classes)`. Importing this package registers every family."""
from models import convnet  # noqa: F401  (registers convnet_tiny, the BN-free model of exactness tests)
from models import resnet  # noqa: F401  (registers the ResNet family)
from models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
