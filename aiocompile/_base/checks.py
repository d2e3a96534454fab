"""Checking settings and arguments where they come in, by one set of rules.

Every number, choice, path and callable that aiocompile takes from its caller (a
``SchedulerConfig`` field, an environment variable, a keyword argument of a public method
or of a pool's constructor) is checked by a rule from here, once, where it comes in; the
code behind trusts what passed. That matters most for the pool's supervisor thread: a bad
number found there (a wait of NaN or infinite seconds) stops it, and every job with it.

The rules are the same everywhere:

- the wrong type raises ``TypeError``: a string where a number is meant, a float where
  an integer is meant, ``True``/``False`` where any number is meant (an int is fine where
  a float is meant);
- a value of the right type that makes no sense raises ``ValueError``: NaN, an infinity,
  a number out of range, an empty path, a name that is not one of the choices;
- the message names the setting and the value, and says what ``None`` would mean where
  it is allowed ("use None for no limit").

A rule is a small frozen value: ``rule.check(setting, value)`` returns the value in the
form the rest of the code reads (a path as ``str``, an integer as ``int``) or raises;
``rule.parse(setting, text)`` does the same for the text of an environment variable.

Rules are plain slotted classes, not dataclasses: this module is imported by
``compile_in_background``'s first call, in a server's event loop, and making a dozen
dataclasses costs that loop milliseconds.
"""

from __future__ import annotations

import numbers
import os
import re
import urllib.parse
from typing import Any

__all__ = [
    "BENCHMARK_TIMEOUT", "CALL_TIMEOUT", "CLOSE_GRACE", "COMPILER", "CRASHES", "DEVICE", "FLAG", "GPU_ARCHS",
    "GPU_OUTPUT", "IDLE_TIMEOUT", "INCLUDE_DIRS", "JOB_TIMEOUT", "LIBRARIES", "MAX_SECONDS", "NATIVE_FLAGS",
    "NATIVE_NAME", "NICE", "POOL_GRACE", "PRELOAD", "RSS", "SOURCE", "SPEC_KIND", "START_METHOD", "SYMBOL", "WORKERS",
    "Choice", "Devices", "Each", "FilePath", "Flag", "Modules", "Number", "Rule", "Secret", "SwitchablePath", "Text",
    "Url", "check_callable",
]

MAX_SECONDS = 1_000_000
"""The longest duration any setting takes, about 11.6 days. The pool's supervisor waits
for its next deadline with ``poll()``, whose timeout is a C int of milliseconds (24.8 days
at most): a longer wait raises ``OverflowError`` in that thread. Where no limit is meant,
``None`` says so."""

_FALSE_WORDS = ("0", "false", "no", "off")
_TRUE_WORDS = ("1", "true", "yes", "on")


class Rule:
    """What a setting takes; see the module docstring. Frozen: its settings are set once,
    by its constructor; rules of one kind with the same settings are equal."""

    __slots__ = ()

    none: str | None = None
    """What ``None`` means for this setting, or None where ``None`` is refused."""

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        names = [name for cls in reversed(type(self).__mro__) for name in getattr(cls, "__slots__", ())]
        return tuple((name, getattr(self, name)) for name in names)

    def _set(self, **settings: Any) -> None:
        for name, value in settings.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a {type(self).__name__} rule cannot be changed")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a {type(self).__name__} rule cannot be changed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in self._settings())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rule) and type(other) is type(self) and self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    def what(self) -> str:
        raise NotImplementedError

    def describe(self, unset: str = "use None") -> str:
        """What the setting takes, for messages; ``unset`` is how a caller asks for what
        ``None`` means (an environment variable is left unset instead)."""
        if self.none is None:
            return self.what()
        return f"{self.what()} ({unset} for {self.none})"

    def check(self, setting: str, value: Any, *, unset: str = "use None") -> Any:
        if value is None:
            if self.none is not None:
                return None
            raise self.wrong_type(setting, value, unset)
        return self._check(setting, value, unset)

    def parse(self, setting: str, text: str) -> Any:
        """The value an environment variable's (stripped, non-empty) text stands for."""
        return self.check(setting, text, unset="leave it unset")

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        raise NotImplementedError

    def wrong_type(self, setting: str, value: Any, unset: str = "use None") -> TypeError:
        return TypeError(f"{setting} must be {self.describe(unset)}, got {value!r} ({type(value).__name__})")

    def bad_value(self, setting: str, value: Any, unset: str = "use None") -> ValueError:
        return ValueError(f"{setting} must be {self.describe(unset)}, got {value!r}")


def _is_number(value: object, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral if integer else numbers.Real)


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


class Number(Rule):
    """A finite real number (or an integer), within bounds; ``above`` is an exclusive
    lower bound."""

    __slots__ = ("integer", "above", "at_least", "at_most", "unit", "none")
    integer: bool
    above: float | None
    at_least: float | None
    at_most: float | None
    unit: str

    def __init__(self, *, integer: bool = False, above: float | None = None, at_least: float | None = None,
                 at_most: float | None = None, unit: str = "", none: str | None = None) -> None:
        self._set(integer=integer, above=above, at_least=at_least, at_most=at_most, unit=unit, none=none)

    def what(self) -> str:
        noun = ("an integer number" if self.unit else "an integer") if self.integer else "a number"
        if self.unit:
            noun += f" of {self.unit}"
        if self.at_least is not None and self.at_most is not None:
            return f"{noun} from {_number_text(self.at_least)} to {_number_text(self.at_most)}"
        bounds = []
        if self.above is not None:
            bounds.append(f"> {_number_text(self.above)}")
        if self.at_least is not None:
            bounds.append(f">= {_number_text(self.at_least)}")
        if self.at_most is not None:
            bounds.append(f"at most {_number_text(self.at_most)}")
        return f"{noun} {' and '.join(bounds)}" if bounds else noun

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not _is_number(value, self.integer):
            raise self.wrong_type(setting, value, unset)
        if self.integer:
            value = int(value)
        elif not isinstance(value, (int, float)):
            value = float(value)
        # Plain comparisons only: they are exact for huge ints too (math.isnan would
        # overflow), and NaN, which compares false with everything, is caught first.
        if value != value or value in (float("inf"), float("-inf")) or not self._in_range(value):
            raise self.bad_value(setting, value, unset)
        return value

    def _in_range(self, value: float) -> bool:
        return ((self.above is None or value > self.above)
                and (self.at_least is None or value >= self.at_least)
                and (self.at_most is None or value <= self.at_most))

    def parse(self, setting: str, text: str) -> Any:
        # The message shows the text as it was given, whatever was wrong with it.
        try:
            return self.check(setting, int(text) if self.integer else float(text), unset="leave it unset")
        except ValueError:
            raise self.bad_value(setting, text, "leave it unset") from None


def _switched_off(text: str) -> bool:
    """Whether an environment variable's text turns a switchable setting off: one of the
    false words (``0``, ``false``, ``no``, ``off``) or ``none``."""
    return text.lower() in (*_FALSE_WORDS, "none")


class SwitchableNumber(Number):
    """A number that may be switched off: ``None`` as a value; in the environment, see
    ``_switched_off``."""

    __slots__ = ()

    def parse(self, setting: str, text: str) -> Any:
        return None if _switched_off(text) else super().parse(setting, text)

    def describe(self, unset: str = "use None") -> str:
        return super().describe("set it to off" if unset == "leave it unset" else unset)


class Choice(Rule):
    """One of a few values, all of one type (names, or warp sizes)."""

    __slots__ = ("values", "none")
    values: tuple[Any, ...]

    def __init__(self, values: tuple[Any, ...], *, none: str | None = None) -> None:
        self._set(values=values, none=none)

    def what(self) -> str:
        shown = [repr(v) for v in self.values]
        return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        kind = type(self.values[0])
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self.wrong_type(setting, value, unset)
        if value not in self.values:
            raise self.bad_value(setting, value, unset)
        return value


class Flag(Rule):
    """True or False; in the environment, 0/1, true/false, yes/no, on/off."""

    __slots__ = ()

    def what(self) -> str:
        return "True or False"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, bool):
            raise self.wrong_type(setting, value, unset)
        return value

    def parse(self, setting: str, text: str) -> Any:
        word = text.lower()
        if word not in _TRUE_WORDS + _FALSE_WORDS:
            raise ValueError(f"{setting} must be one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)}, got {text!r}")
        return word in _TRUE_WORDS


class FilePath(Rule):
    """A file or directory name: a non-empty ``str`` or ``os.PathLike``, kept as ``str``."""

    __slots__ = ("none",)

    def __init__(self, *, none: str | None = None) -> None:
        self._set(none=none)

    def what(self) -> str:
        return "a non-empty path"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, (str, os.PathLike)):
            raise self.wrong_type(setting, value, unset)
        text = os.fspath(value)
        if not isinstance(text, str):  # a bytes path: every path aiocompile keeps is text
            raise self.wrong_type(setting, value, unset)
        if not text.strip():
            raise self.bad_value(setting, value, unset)
        return text


class SwitchablePath(FilePath):
    """A path that may be switched off: ``None`` as a value; in the environment, one of
    the false words (``0``, ``false``, ``no``, ``off``) or ``none``."""

    __slots__ = ()

    def parse(self, setting: str, text: str) -> Any:
        return None if _switched_off(text) else self.check(setting, text, unset="set it to off")


_ENTRY = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?$")


class Modules(Rule):
    """A tuple of preload entries, ``"module"`` or ``"module:function"``."""

    __slots__ = ()

    def what(self) -> str:
        return "a tuple of 'module' or 'module:function' names"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        # A lone string would be taken apart letter by letter.
        if not isinstance(value, (tuple, list)) or not all(isinstance(entry, str) for entry in value):
            raise self.wrong_type(setting, value, unset)
        for entry in value:
            if not _ENTRY.match(entry):
                raise ValueError(f"{setting} must be {self.what()}, got {value!r} (whose {entry!r} is not one)")
        return tuple(value)


class Secret(Rule):
    """A secret: non-empty ``bytes`` or ``str``. Messages never show its value."""

    __slots__ = ("none",)

    def __init__(self, *, none: str | None = None) -> None:
        self._set(none=none)

    def what(self) -> str:
        return "non-empty bytes or str"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, (bytes, str)):
            raise TypeError(f"{setting} must be {self.describe(unset)}, got a {type(value).__name__}")
        if not value:
            raise ValueError(f"{setting} must be {self.describe(unset)}, got an empty {type(value).__name__}")
        return value


class Devices(Rule):
    """Device indices: a non-empty tuple of distinct integers >= 0; in the environment,
    comma-separated (``0,1``)."""

    __slots__ = ("none",)

    def __init__(self, *, none: str | None = None) -> None:
        self._set(none=none)

    def what(self) -> str:
        return "a non-empty tuple of distinct device indices (integers >= 0)"

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, (tuple, list)) or not all(_is_number(v, True) for v in value):
            raise self.wrong_type(setting, value, unset)
        devices = tuple(int(v) for v in value)
        if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
            raise self.bad_value(setting, value, unset)
        return devices

    def parse(self, setting: str, text: str) -> Any:
        # The message shows the text as it was given, whatever was wrong with it.
        try:
            return self.check(setting, tuple(int(part) for part in text.split(",") if part.strip()),
                              unset="leave it unset")
        except ValueError:
            raise self.bad_value(setting, text, "leave it unset") from None


class Text(Rule):
    """A ``str`` without NUL characters (a compiler would stop reading it there): not empty
    unless ``empty``, and matching ``pattern`` where there is one."""

    __slots__ = ("noun", "pattern", "empty", "none")
    noun: str
    pattern: str | None
    empty: bool

    def __init__(self, noun: str = "a non-empty string", *, pattern: str | None = None, empty: bool = False,
                 none: str | None = None) -> None:
        self._set(noun=noun, pattern=pattern, empty=empty, none=none)

    def what(self) -> str:
        return self.noun

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, str):
            raise self.wrong_type(setting, value, unset)
        if "\x00" in value or (not value and not self.empty):
            raise self.bad_value(setting, value, unset)
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise self.bad_value(setting, value, unset)
        return value


class Each(Rule):
    """A tuple (a list is taken too) whose items ``item`` checks; kept as a tuple. A lone
    item stands for a tuple of one only where ``one`` says so: elsewhere a lone string
    would be taken apart letter by letter, and is refused."""

    __slots__ = ("item", "noun", "one", "at_least_one")
    item: Rule
    noun: str
    one: bool
    at_least_one: bool

    def __init__(self, item: Rule, noun: str, *, one: bool = False, at_least_one: bool = False) -> None:
        self._set(item=item, noun=noun, one=one, at_least_one=at_least_one)

    def what(self) -> str:
        text = f"a tuple of {self.noun}" + (" (or a single one)" if self.one else "")
        return text + (", not empty" if self.at_least_one else "")

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if self.one and isinstance(value, (str, os.PathLike)):
            value = (value,)
        if not isinstance(value, (tuple, list)):
            raise self.wrong_type(setting, value, unset)
        if self.at_least_one and not value:
            raise self.bad_value(setting, value, unset)
        return tuple(self.item.check(f"{setting}[{index}]", entry) for index, entry in enumerate(value))


class Url(Rule):
    """A URL of one of ``schemes`` naming a server (a host, or for ``unix`` a socket path).
    Messages never show a password it carries."""

    __slots__ = ("schemes", "none")
    schemes: tuple[str, ...]

    def __init__(self, schemes: tuple[str, ...], *, none: str | None = None) -> None:
        self._set(schemes=schemes, none=none)

    def what(self) -> str:
        return "a URL such as " + " or ".join(f"{scheme}://..." for scheme in self.schemes)

    def _check(self, setting: str, value: Any, unset: str) -> Any:
        if not isinstance(value, str):
            raise TypeError(f"{setting} must be {self.describe(unset)}, got a {type(value).__name__}")
        text = value.strip()
        parts = urllib.parse.urlsplit(text)
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else text
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if parts.scheme not in self.schemes or not port_ok or not (parts.hostname if parts.scheme != "unix"
                                                                   else parts.path):
            raise ValueError(f"{setting} must be {self.describe(unset)}, got {shown!r}")
        return text


def check_callable(setting: str, value: Any) -> Any:
    if not callable(value):
        raise TypeError(f"{setting} must be callable, got {value!r} ({type(value).__name__})")
    return value


WORKERS = Number(integer=True, at_least=1)
CRASHES = Number(integer=True, at_least=1)
NICE = Number(integer=True, at_least=0, at_most=19)
FLAG = Flag()
RSS = Number(integer=True, above=0, unit="bytes", none="no limit")
START_METHOD = Choice(("forkserver", "spawn", "fork"), none="the best start method here")
PRELOAD = Modules()
JOB_TIMEOUT = Number(above=0, at_most=MAX_SECONDS, unit="seconds", none="no limit")
"""A job's timeout where ``None`` means none (a config, a pool's job)."""
CALL_TIMEOUT = Number(above=0, at_most=MAX_SECONDS, unit="seconds", none="the scheduler's timeout")
"""A request's ``timeout=``: ``None`` means the scheduler's."""
IDLE_TIMEOUT = Number(above=0, at_most=MAX_SECONDS, unit="seconds", none="no limit")
DEVICE = Number(integer=True, at_least=0, none="the current device")
"""``autotune(device=)``."""
BENCHMARK_TIMEOUT = Number(above=0, at_most=MAX_SECONDS, unit="seconds", none="no limit")
CLOSE_GRACE = Number(at_least=0, at_most=MAX_SECONDS, unit="seconds", none="the configuration's close_grace")
POOL_GRACE = Number(at_least=0, at_most=MAX_SECONDS, unit="seconds", none="no limit")

# compile_cpp / compile_cuda (and their compile_many specs)
SOURCE = Text("source text (a str)", empty=True)
NATIVE_FLAGS = Each(Text("a compiler flag"), "compiler flags (str), such as ('-O2',)")
INCLUDE_DIRS = Each(FilePath(), "directories (str or path)")
LIBRARIES = Each(Text("a library: a name such as 'm' (linked as -lm) or the path of a library file"), "libraries")
COMPILER = FilePath(none="the one found on PATH (nvcc: also in CUDA_HOME or CUDA_PATH)")
NATIVE_NAME = Text("a name for records and errors", pattern=r"[^\n]+", none="one taken from the source")
GPU_ARCHS = Each(
    Text("a GPU architecture such as 'sm_90', 'compute_90' or 'gfx942'",
         pattern=r"(?:sm|compute)_\d{2,3}[af]?|gfx[0-9a-f]{3,4}(?::[a-z0-9]+[+-])*"),
    "GPU architectures such as 'sm_90', 'compute_90' or 'gfx942'", one=True, at_least_one=True)
GPU_OUTPUT = Choice(("cubin", "fatbin", "ptx", "shared", "hsaco"))
SPEC_KIND = Choice(("triton", "cpp", "cuda"))
"""What a ``compile_many`` spec compiles: its ``"kind"`` (absent: Triton)."""
SYMBOL = Text("a symbol name", pattern=r"[A-Za-z_$][\w$@.]*")
