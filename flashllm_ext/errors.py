"""Exceptions shared by every loader."""

from __future__ import annotations


class FormatError(ValueError):
    """A file or a set of arrays does not follow its format. The message names the file (if any) and the field."""

    def __init__(self, field: str, problem: str, path: str | None = None):
        self.field = field
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{field}: {problem}")
