"""Exceptions the CLI prints as plain messages."""


class UserError(Exception):
    """Something the user can fix: the message says what and how."""
