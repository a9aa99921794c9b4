"""kvferry's exceptions: one class per status code of the C++ library.

Every failed call raises a subclass of :class:`Error`, which carries the library's status code
(``.code``, e.g. ``"INVALID_ARGUMENT"``) and message (``.message``, naming the offending values).
The subclasses also derive from the closest built-in exception, so ``except ValueError`` or
``except TimeoutError`` work as a Python user expects.
"""

from __future__ import annotations


class Error(Exception):
    """A kvferry call failed. ``code`` is the status code name, ``message`` says what and why."""

    code: str = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgumentError(Error, ValueError):
    """The caller passed something wrong; the same call fails again."""

    code = "INVALID_ARGUMENT"


class ClosedError(InvalidArgumentError):
    """An object was used after close() (or after its ``with`` block)."""

    code = "INVALID_ARGUMENT"


class NotFoundError(Error, LookupError):
    """An id, key, knob or file that does not exist."""

    code = "NOT_FOUND"


class UnavailableError(Error, ConnectionError):
    """A backend, device or peer can't be used now."""

    code = "UNAVAILABLE"


class DeadlineExceededError(Error, TimeoutError):
    """A wait ran past its deadline."""

    code = "DEADLINE_EXCEEDED"


class DataLossError(Error, IOError):
    """Bytes are corrupt or missing."""

    code = "DATA_LOSS"


class CancelledError(Error):
    """The operation was cancelled by a caller."""

    code = "CANCELLED"


class InternalError(Error, RuntimeError):
    """A broken invariant or an unexpected foreign error."""

    code = "INTERNAL"


class ResourceExhaustedError(Error, MemoryError):
    """Out of memory, disk space or slots."""

    code = "RESOURCE_EXHAUSTED"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        UnavailableError,
        DeadlineExceededError,
        DataLossError,
        CancelledError,
        InternalError,
        ResourceExhaustedError,
    )
}


def error_for(code: str, message: str) -> Error:
    """The exception for a status code name (used by the extension module)."""
    if code == "CLOSED":
        return ClosedError(message)
    return _BY_CODE.get(code, Error)(message, code)
