"""The one exception every layer may raise for a set-up mistake, and how a mistake is worded; it imports nothing
from bench.

A ConfigError stops a cell before training with exit code 2 and no record (bench/running/run.py): a bad option,
a missing file, a download that cannot happen. `bench.running.config.ConfigError` is the same class.
"""


import difflib
import traceback


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


def first_line(error: BaseException) -> str:
    """An error as `<type>: <its first line>`."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def where_raised(error: BaseException) -> str:
    """` at <file>:<line>` where the error arose in the user's code: a syntax error's own place, else its traceback's
    last frame outside the import machinery and Hydra's lookup (or nothing)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" at {error.filename}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")
              and "/importlib/" not in f.filename and "/hydra/" not in f.filename]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def located(path: str, key: str, what: str):
    """The object at dotted `path` (a model's builder, a scaling method's class), or a ConfigError naming `key`, the
    error its import raised and where (Hydra's lookup wraps it as "Error loading ..., are you sure that module is
    installed?", and logs that first), and what must be importable (`what`)."""
    import logging

    from hydra.utils import get_object

    hydra_log = logging.getLogger("hydra.utils")
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)
    try:
        return get_object(path)
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{key}={path} cannot be imported{where_raised(cause)}: {first_line(cause)}; {what} must be "
                          "importable (on PYTHONPATH): docs/extending.md") from None
    finally:
        hydra_log.setLevel(level)
