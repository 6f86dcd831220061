"""The one exception type for bad input.

Anything a user can cause (a wrong spec, a corrupt file, an unsupported architecture)
raises `LlmoptError` with a message that says what is wrong and what to do. The CLI
prints that message on one line and exits with code 2; library callers catch it.
"""

from __future__ import annotations


class LlmoptError(ValueError):
    """Bad input or an unsupported request, explained in the message.

    A refused request names what it got wrong where the raise site knows: `param`, the field at
    fault ("prompt", or a SamplingParams field), and `code`, a machine-readable reason (OpenAI's,
    e.g. "context_length_exceeded"). The server turns both into its OpenAI error object.
    """

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
