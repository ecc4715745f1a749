"""The format API, where users import it: `quantise` and its kin, and what a format of your own is made of
(docs/extending.md, "Bring your own format"). The formats live in bench/numerics/formats.py (element formats) and
bench/numerics/specs.py (training formats)."""

from bench.numerics.formats import (
    FORMATS,
    NAN_ENCODINGS,
    OVERFLOW_POLICIES,
    ElementFormat,
    get_format,
    quantise,
    quantise_stochastic,
    quantise_value,
    register_element,
)
from bench.numerics.hardware import NativeSupport, emulated_everywhere
from bench.numerics.specs import FORMAT_SPECS, MODES, FormatSpec, Recipe
from bench.numerics.specs import register as register_format

__all__ = ["FORMATS", "FORMAT_SPECS", "MODES", "NAN_ENCODINGS", "OVERFLOW_POLICIES", "ElementFormat", "FormatSpec",
           "NativeSupport", "Recipe", "emulated_everywhere", "get_format", "quantise", "quantise_stochastic",
           "quantise_value", "register_element", "register_format"]
