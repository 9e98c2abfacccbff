"""The router's refusal of a request, and how an error message quotes what was sent.

Below the parameter table (`param_table`: a bound's check raises it) and every parser
(`api_params`, `tokenize_params`, `chat`): each problem is an `InvalidRequest` naming the
parameter, answered as an OpenAI error (HTTP 400 unless it says otherwise).
"""

from __future__ import annotations

import reprlib
from typing import Any


class InvalidRequest(Exception):
    """A request the router answers with an OpenAI error instead of running it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type


_reprs = reprlib.Repr()
_reprs.maxstring = _reprs.maxother = 80
_reprs.maxlong = 40


def show(value: Any) -> str:
    """A value as an error message quotes it: repr, shortened (a body may be megabytes)."""
    return _reprs.repr(value)
