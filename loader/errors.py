"""Errors that reach the user as one line."""


class KxlbError(Exception):
    """An error whose message is complete and meant for the user as is."""


class MapWriteError(KxlbError):
    """The kernel refused a map write (ENOMEM, a racing writer, a map replaced under us):
    worth retrying, unlike an input the maps cannot hold (which raises KxlbError)."""


class FrontendConflict(KxlbError):
    """Frontends of a service port that another service port already serves (two Services
    listing the same externalIP and port, say)."""

    def __init__(self, message: str, frontends: list):
        super().__init__(message)
        self.frontends = frontends
