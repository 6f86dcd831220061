"""The one exception type for bad input.

Anything a user can cause (a wrong spec, a corrupt file, an unsupported architecture)
raises `LlmoptError` with a message that says what is wrong and what to do. The CLI
prints that message on one line and exits with code 2; library callers catch it.
"""


class LlmoptError(ValueError):
    """Bad input or an unsupported request, explained in the message."""
