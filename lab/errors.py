"""The lab's error: what failed and where its log is."""


class LabError(RuntimeError):
    """A lab operation failed; the message says what and where the log is."""
