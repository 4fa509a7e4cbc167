"""Errors that reach the user as one line."""


class KxlbError(Exception):
    """An error whose message is complete and meant for the user as is."""
