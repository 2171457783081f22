"""Errors a user can cause: the CLI prints them as one line and exits 2, never a traceback."""


class UserError(Exception):
    """Bad input (config, checkpoint, flag, mesh): the message names the input and what to do."""
