"""Moved to bench.speed.model and bench.speed.profiles (0.3.0); this alias goes in the next release."""

from bench.speed.model import (  # noqa: F401
                               CONSTANTS,
                               Constants,
                               NoNativePath,
                               Prediction,
                               Recipe,
                               predict,
                               predictions,
                               recipe_on,
                               step_memory,
)
from bench.speed.profiles import GPU, gpu, shipped_gpus  # noqa: F401
