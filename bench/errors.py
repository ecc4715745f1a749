"""The one exception every layer may raise for a set-up mistake, and how a mistake is worded; it imports nothing
from bench.

A ConfigError stops a cell before training with exit code 2 and no record (bench/running/run.py): a bad option,
a missing file, a download that cannot happen. `bench.running.config.ConfigError` is the same class.
"""


import difflib


class ConfigError(ValueError):
    """The composed config asks for something that does not exist or cannot be combined, or its inputs are
    not there."""


def check_choice(value, valid, key: str, error: type[ConfigError] = ConfigError):
    """`value` if it is one of `valid`; else `error`, in the one wording every choice is refused with."""
    if value not in valid:
        raise error(f"{key}={value!r} is not valid; valid: {', '.join(map(str, valid))}")
    return value


def suggestion(value, valid, prefix: str = "") -> str:
    """` (did you mean <prefix><nearest>?)` for the valid choice nearest to `value`, or nothing (case aside: FP8 is
    fp8's nearest, which difflib alone does not find)."""
    by_lower = {str(v).lower(): str(v) for v in valid}
    close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1)
    return f" (did you mean {prefix}{by_lower[close[0]]}?)" if close else ""
