"""`bench.formats.quantise` and its kin, where users import them: the formats live in bench/numerics/formats.py."""

from bench.numerics.formats import (
                                    FORMATS,
                                    OVERFLOW_POLICIES,
                                    ElementFormat,
                                    get_format,
                                    quantise,
                                    quantise_stochastic,
                                    quantise_value,
)

__all__ = ["FORMATS", "OVERFLOW_POLICIES", "ElementFormat", "get_format", "quantise", "quantise_stochastic",
           "quantise_value"]
