"""Errors that name what went wrong and where."""


class AlignflowError(Exception):
    """Base class: every error alignflow raises on purpose."""


class PluginError(AlignflowError):
    """A plugin failed to load, clashed with another, or is not known."""


class SpecError(AlignflowError):
    """A pipeline spec is invalid; the message names the file, stage and field."""


class DataError(AlignflowError):
    """A dataset row is malformed; the message reads `file:row: field ...`."""
