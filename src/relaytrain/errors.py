"""Errors a user can fix. The CLI prints them as one line on stderr and exits with code 2."""


class ConfigError(Exception):
    """A bad config, bad input data or a run the machine cannot hold; the message names the fix."""
