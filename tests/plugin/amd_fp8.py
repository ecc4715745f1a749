"""A plug-in declaring AMD's FP8 formats, as a user would (docs/extending.md's worked format): the MI300's E4M3FNUZ and
E5M2FNUZ, and the training format `fp8fnuz` that runs them as `fp8` runs OCP's E4M3 and E5M2. Named in `plugins:`
(`plugins=[amd_fp8]`), it is imported by every command, so `format=fp8fnuz` works with any model."""

from bench.formats import ElementFormat, FormatSpec, Recipe, emulated_everywhere, register_element, register_format

# FNUZ: "finite, no negative zero": bias 8 (16 for E5M2), no infinities, the -0 code (0x80) is the only NaN, so the
# top binade keeps all its codes: E4M3FNUZ reaches 1.875 * 2^7 = 240, E5M2FNUZ 1.75 * 2^15 = 57344.
register_element(ElementFormat.from_bits("fp8_e4m3fnuz", 4, 3, bias=8, nan="negative_zero", negative_zero=False))
register_element(ElementFormat.from_bits("fp8_e5m2fnuz", 5, 2, bias=16, nan="negative_zero", negative_zero=False))

register_format(FormatSpec(
    "fp8fnuz", modes=("mixed",),
    recipe=Recipe(inputs="fp8_e4m3fnuz", grads="fp8_e5m2fnuz", sixteen_bit_kernel=False),
    native=emulated_everywhere("fp8fnuz is emulated here: no device this suite knows multiplies FNUZ FP8"),
    stochastic_rounding=True,  # format.rounding=stochastic applies to the gradients
    gemm_only=True))  # only GEMM operands are FP8: format.elsewhere chooses the rest (bf16, as fp8.yaml does)
