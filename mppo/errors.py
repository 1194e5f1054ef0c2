"""The one base class for mistakes a user can fix (bad config, data, checkpoint, layout, missing package).

`mppo` commands print such an error as one line naming the problem and the fix, and exit 2, with no traceback;
anything else is a bug and keeps its traceback. This module sits below every other: it imports nothing.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem in what the user gave mppo; its message says what is wrong and how to fix it."""
